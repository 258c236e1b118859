// Dense float matrices (float32, float16 or bfloat16 weights, as a Hugging Face folder stores them) times float32
// or bfloat16 activations, each output value computed the same way whatever else the call holds:
//
//     part[c]  = fma(x[r][i1-1], w[j][i1-1], ... fma(x[r][i0], w[j][i0], 0))   for i0 = 256 c, i1 = min(i0 + 256, k)
//     y[r][j]  = (((0 + part[0]) + part[1]) + ...) + part[last]
//
// chains of FMAs over k in order, 256 values each, summed in order, in float32 (f16 and bf16 weights and bf16
// activations convert exactly; a build without FMA instructions multiplies and adds, rounding each). No other row
// of x, no register block, thread count or thread's share enters that sequence, so a row's output has the same bits
// alone or among hundreds of rows: batch invariance by construction (MKL's GEMM sums in an order that depends on
// the number of rows). Short chains keep the rounding error near MKL's (one chain over k = 4864 had 10 times it).
//
// Layout: the weights are rearranged once (pack_dense) into panels of 8 rows, value i of the 8 rows side by side,
// so one vector holds 8 output columns' weights for one i; the last n % 8 rows follow the panels as they were, row
// after row. The same bytes as the rows.
//
// The product is the classic outer-product register block (BLIS's): MR activation rows times NP panels, MR * NP
// accumulators, each step i loading NP weight vectors and broadcasting MR activations; a lane of an accumulator is
// one output value's chain. Decode's few rows take many panels at once (1 row x 8 panels .. 8 rows x 1), prefill's
// many rows blocks of 4 to 6 rows x 2 panels. x is first copied into its blocks, each block's rows interleaved
// (one stream to read, at any k). Threads take equal contiguous shares of the panels, never of k; a thread takes
// its share NP panels at a time and passes all of x's blocks over them, so each weight is read from memory once
// and stays in cache while the blocks pass. (Software prefetch of the weights, ahead in the loop over k or of the
// next panels as products.h does, made decode slower on Zen 3: the panels are plain streams the hardware prefetcher
// follows.)
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "formats.h"
#include "layer_ops.h"
#include "products.h"

namespace kvlm {

constexpr int PANEL_ROWS = 8;
constexpr int PANEL_VECTORS = PANEL_ROWS / LANES;  // vectors across a panel's 8 columns: 1 with AVX2
constexpr int MAX_BLOCK_ROWS = 8;    // x's rows in one register block: 8 x 1 panel .. 1 x 8 panels
constexpr int LARGE_BLOCK_ROWS = 6;  // rows per block of a large x: 6 x 2 panels, 12 accumulators
constexpr int64_t CHAIN = 256;       // values of k per chain of FMAs

// total + part, as an FMA by one: the same bits as an add (attention.h's vectors have no add).
inline fvec vadd(fvec total, fvec part) { return vfma(part, vset(1.0f), total); }

// The weights' types, numbered as KV planes' (attention.h): KV_F32, KV_F16, KV_BF16.
template <int TYPE> using Stored = std::conditional_t<TYPE == KV_F32, float, uint16_t>;

// Calls f(TypeTag<type>{}) for a dense weight type; false for any other.
template <class F> bool with_dense_type(int type, F&& f) {
    switch (type) {
        case KV_F32: f(TypeTag<KV_F32>{}); return true;
        case KV_F16: f(TypeTag<KV_F16>{}); return true;
        case KV_BF16: f(TypeTag<KV_BF16>{}); return true;
        default: return false;
    }
}

template <int TYPE> inline fvec weight_vector(const Stored<TYPE>* p) {
    if constexpr (TYPE == KV_F32) return vload(p);
    else return vhalves(p, TYPE == KV_BF16);
}

template <int TYPE> inline float weight_value(const Stored<TYPE>* p) {
    if constexpr (TYPE == KV_F32) return *p;
    else if constexpr (TYPE == KV_BF16) return bf16_to_float(*p);
    else return fp16_to_float(*p);
}

// Rows 8 p .. 8 p + 7 of w [n][k] into panel p of `packed`: value i of row 8 p + c at 8 p k + 8 i + c.
template <class T> void pack_panel(const T* w, int64_t k, int64_t p, T* packed) {
    const T* rows = w + p * PANEL_ROWS * k;
    T* panel = packed + p * PANEL_ROWS * k;
    for (int64_t i = 0; i < k; ++i)
        for (int c = 0; c < PANEL_ROWS; ++c) panel[i * PANEL_ROWS + c] = rows[c * k + i];
}

// w [n][k] of `type` into `packed` (as many bytes) in the layout above, by n_threads threads.
inline int pack_dense(const void* w, int type, int64_t n, int64_t k, void* packed, int n_threads) {
    if (n <= 0 || k <= 0) return BAD_SHAPE;
    const bool known = with_dense_type(type, [&](auto tag) {
        using T = Stored<decltype(tag)::value>;
        const T* rows = static_cast<const T*>(w);
        T* out = static_cast<T*>(packed);
        const int64_t panels = n / PANEL_ROWS, packed_values = panels * PANEL_ROWS * k;
#pragma omp parallel for num_threads(n_threads) schedule(static)
        for (int64_t p = 0; p < panels; ++p) pack_panel(rows, k, p, out);
        std::memcpy(out + packed_values, rows + packed_values, size_t(n * k - packed_values) * sizeof(T));
    });
    return known ? OK : BAD_SHAPE;
}

// One product's operands: x's rows packed in register blocks (pack_rows_in_team), the packed weights, y [m][n]
// float32 or bfloat16.
struct DenseWork {
    const float* x;
    const void* weights;
    int64_t m, k, n;
    void* y;
    bool y_bf16;

    int64_t panels() const { return n / PANEL_ROWS; }
    // x's rows in register blocks: up to 8 rows make one block; more, ceil(m / 6) blocks of even sizes (4 to 6
    // rows), so no block is left with a row or two (too few accumulators to keep the FMA units busy).
    int64_t blocks() const { return m <= MAX_BLOCK_ROWS ? 1 : (m + LARGE_BLOCK_ROWS - 1) / LARGE_BLOCK_ROWS; }
    int64_t block_start(int64_t b) const { return m * b / blocks(); }
};

// A panel's 8 output values into y from `at`.
inline void store_panel(const DenseWork& w, int64_t at, const fvec* lanes) {
    if (!w.y_bf16) {
        for (int v = 0; v < PANEL_VECTORS; ++v) vstore(static_cast<float*>(w.y) + at + v * LANES, lanes[v]);
        return;
    }
    float values[PANEL_ROWS];
    for (int v = 0; v < PANEL_VECTORS; ++v) vstore(values + v * LANES, lanes[v]);
    for (int c = 0; c < PANEL_ROWS; ++c) static_cast<uint16_t*>(w.y)[at + c] = float_to_bf16(values[c]);
}

// y's rows r0 .. r0 + MR - 1 (x's block from r0) at the columns of panels p0 .. p0 + NP - 1.
template <int TYPE, int MR, int NP> void block_times(const DenseWork& w, int64_t r0, int64_t p0) {
    const int64_t k = w.k;
    const Stored<TYPE>* panels = static_cast<const Stored<TYPE>*>(w.weights) + p0 * PANEL_ROWS * k;
    const float* x = w.x + r0 * k;
    fvec total[MR][NP][PANEL_VECTORS], acc[MR][NP][PANEL_VECTORS];
    for (auto& row : total)
        for (auto& panel : row)
            for (fvec& lanes : panel) lanes = vzero();
    for (int64_t i0 = 0; i0 < k; i0 += CHAIN) {
        for (auto& row : acc)
            for (auto& panel : row)
                for (fvec& lanes : panel) lanes = vzero();
        for (int64_t i = i0; i < std::min(i0 + CHAIN, k); ++i) {
            fvec values[NP][PANEL_VECTORS];
            for (int p = 0; p < NP; ++p)
                for (int v = 0; v < PANEL_VECTORS; ++v)
                    values[p][v] = weight_vector<TYPE>(panels + (p * k + i) * PANEL_ROWS + v * LANES);
            for (int r = 0; r < MR; ++r) {
                const fvec activation = vset(x[i * MR + r]);
                for (int p = 0; p < NP; ++p)
                    for (int v = 0; v < PANEL_VECTORS; ++v) acc[r][p][v] = vfma(activation, values[p][v], acc[r][p][v]);
            }
        }
        for (int r = 0; r < MR; ++r)
            for (int p = 0; p < NP; ++p)
                for (int v = 0; v < PANEL_VECTORS; ++v) total[r][p][v] = vadd(total[r][p][v], acc[r][p][v]);
    }
    for (int r = 0; r < MR; ++r)
        for (int p = 0; p < NP; ++p) store_panel(w, (r0 + r) * w.n + (p0 + p) * PANEL_ROWS, total[r][p]);
}

// Panels per register block of `rows` rows: 8 accumulators at least (each FMA waits ~4 cycles for the one before
// it in its chain), at most 12 (with the weights and a broadcast, AVX2's 16 registers).
constexpr int panels_for(int64_t rows) { return rows == 1 ? 8 : rows <= 3 ? 4 : rows <= LARGE_BLOCK_ROWS ? 2 : 1; }

// f(integral_constant<np>) for np a power of two up to MOST (a block of MR rows never takes more panels than
// panels_for(MR)): only the blocks that can occur are compiled.
template <int MOST, class F> inline void with_panels(int np, F&& f) {
    if constexpr (MOST >= 8) if (np == 8) return f(std::integral_constant<int, 8>{});
    if constexpr (MOST >= 4) if (np == 4) return f(std::integral_constant<int, 4>{});
    if constexpr (MOST >= 2) if (np == 2) return f(std::integral_constant<int, 2>{});
    f(std::integral_constant<int, 1>{});
}

// y's columns of panels p_begin <= p < p_end for all of x's rows: each group of panels (as many as the blocks
// take, fewer at the end of the share) read from memory once, then in cache while every block passes over it.
template <int TYPE> void multiply_panels(const DenseWork& w, int64_t p_begin, int64_t p_end) {
    for (int64_t p0 = p_begin; p0 < p_end;) {
        int np = panels_for(w.block_start(1) - w.block_start(0));
        while (np > p_end - p0) np /= 2;
        for (int64_t b = 0; b < w.blocks(); ++b) {
            const int64_t r0 = w.block_start(b);
            with_group(int(w.block_start(b + 1) - r0), [&](auto rows) {
                constexpr int MR = decltype(rows)::value;
                with_panels<panels_for(MR)>(np, [&](auto panels) {
                    block_times<TYPE, MR, decltype(panels)::value>(w, r0, p0);
                });
            });
        }
        p0 += np;
    }
}

// One output value by the panels' own operations (vfma and vadd, lane by lane): a row left out of the panels gets
// the bits a panel's lane would give it. x: the activations, x_step values apart.
template <int TYPE> float chains_of(const float* x, int64_t x_step, const Stored<TYPE>* w, int64_t k) {
    fvec total = vzero();
    for (int64_t i0 = 0; i0 < k; i0 += CHAIN) {
        fvec acc = vzero();
        for (int64_t i = i0; i < std::min(i0 + CHAIN, k); ++i)
            acc = vfma(vset(x[i * x_step]), vset(weight_value<TYPE>(w + i)), acc);
        total = vadd(total, acc);
    }
    float lanes[LANES];
    vstore(lanes, total);
    return lanes[0];
}

// y's last n % 8 columns, from the rows after the panels.
template <int TYPE> void multiply_rows_after_panels(const DenseWork& w) {
    const Stored<TYPE>* rows = static_cast<const Stored<TYPE>*>(w.weights) + w.panels() * PANEL_ROWS * w.k;
    for (int64_t j = w.panels() * PANEL_ROWS; j < w.n; ++j, rows += w.k)
        for (int64_t b = 0; b < w.blocks(); ++b) {
            const int64_t r0 = w.block_start(b), block_rows = w.block_start(b + 1) - r0;
            for (int64_t r = 0; r < block_rows; ++r)
                store_value(w.y, w.y_bf16, (r0 + r) * w.n + j,
                            chains_of<TYPE>(w.x + r0 * w.k + r, block_rows, rows, w.k));
        }
}

// x [m][k] (float32 or bfloat16) as float32 into `packed` (the caller's, shared by the team), by every thread of
// the calling team (which waits): each register block's rows interleaved, value i of its rows side by side, so a
// block reads one stream (rows k values apart may share cache sets, as when k is a multiple of 1024).
inline const float* pack_rows_in_team(const DenseWork& w, const void* x, bool bf16, std::vector<float>& packed) {
#pragma omp single
    packed.resize(size_t(w.m * w.k));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < w.blocks(); ++b) {
        const int64_t r0 = w.block_start(b), rows = w.block_start(b + 1) - r0;
        float* block = packed.data() + r0 * w.k;
        for (int64_t i = 0; i < w.k; ++i)
            for (int64_t r = 0; r < rows; ++r) block[i * rows + r] = load_value(x, bf16, (r0 + r) * w.k + i);
    }
    return packed.data();
}

// y = x times the packed weights' transpose, run by every thread of the calling team: each an equal share of the
// panels, the rows after the panels counted as one more panel (the last).
template <int TYPE> void dense_product_in_team(DenseWork w, const void* x, bool x_bf16, std::vector<float>& packed) {
    w.x = pack_rows_in_team(w, x, x_bf16, packed);
    const int64_t panels = w.panels(), units = panels + (w.n % PANEL_ROWS != 0);
    const int count = omp_get_num_threads(), thread = omp_get_thread_num();
    const int64_t begin = units * thread / count, end = units * (thread + 1) / count;
    multiply_panels<TYPE>(w, begin, std::min(end, panels));
    if (end > panels) multiply_rows_after_panels<TYPE>(w);
}

// y [m][n] = x [m][k] times the transpose of weights packed by pack_dense, by n_threads threads.
inline int dense_product(const void* x, bool x_bf16, int64_t m, int64_t k, const void* weights, int type, int64_t n,
                         void* y, bool y_bf16, int n_threads) {
    if (m < 0 || k <= 0 || n <= 0) return BAD_SHAPE;
    if (m == 0) return OK;
    static thread_local std::vector<float> packed_x;
    std::vector<float>* shared = &packed_x;  // the calling thread's (in the team, `packed_x` is each thread's own)
    const DenseWork work{nullptr, weights, m, k, n, y, y_bf16};
    const bool known = with_dense_type(type, [&](auto tag) {
#pragma omp parallel num_threads(n_threads)
        dense_product_in_team<decltype(tag)::value>(work, x, x_bf16, *shared);
    });
    return known ? OK : BAD_SHAPE;
}

}  // namespace kvlm
