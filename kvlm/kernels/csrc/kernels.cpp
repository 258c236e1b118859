// kvlm's native kernels, called through ctypes (see kvlm/kernels/native.py): products that read GGUF's quantized
// blocks as the file stores them, their exact dequantization, and a layer's small ops (layer_ops.h).
//
// Threads: OpenMP, linked against the runtime torch has already loaded (the same libgomp.so.1), so torch's ops
// and these share one pool of threads; the caller passes torch's thread count.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "activations.h"
#include "dot.h"
#include "formats.h"
#include "layer_ops.h"

using namespace kvlm;

namespace {

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
        case Q4_K: f(TypeTag<Q4_K>{}); return true;
        case Q5_K: f(TypeTag<Q5_K>{}); return true;
        case Q6_K: f(TypeTag<Q6_K>{}); return true;
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
#if defined(KVLM_AVX512) || defined(KVLM_AVX2)
    unpack<TYPE>(row + first * B::bytes, n, c);
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

constexpr int MAX_TILE = 4;  // activation rows sharing one read of a weight row's blocks

// Rows j0 <= j < j1 of one part (all of one type) times every activation row, into y's columns offset + j.
template <int TYPE> void product_rows(const uint8_t* weights, int64_t k, int64_t j0, int64_t j1,
                                      const QuantizedRows& act, void* y, bool y_bf16, int64_t y_cols,
                                      int64_t y_offset) {
    const int64_t m = act.n_rows;
    float sums[MAX_TILE];
    for (int64_t j = j0; j < j1; ++j) {
        const uint8_t* row = weights + j * row_bytes<TYPE>(k);
        for (int64_t r0 = 0; r0 < m; r0 += MAX_TILE) {
            const int tile = int(std::min<int64_t>(MAX_TILE, m - r0));
            switch (tile) {
                case 1: dot_row<TYPE, 1>(row, k, act, r0, sums); break;
                case 2: dot_row<TYPE, 2>(row, k, act, r0, sums); break;
                case 3: dot_row<TYPE, 3>(row, k, act, r0, sums); break;
                default: dot_row<TYPE, 4>(row, k, act, r0, sums); break;
            }
            for (int t = 0; t < tile; ++t) store(y, y_bf16, (r0 + t) * y_cols + y_offset + j, sums[t]);
        }
    }
}

// body(i) for i < n: serially when the work (`size` values) is too small to share, else over the pool's threads.
// Small work never opens a team of one: libgomp would resize its pool between such a region and the next full one,
// and the full one's workers then start from sleep (oneDNN's products after them ran 3x slower).
template <class F> void for_rows(int64_t n, int64_t size, int n_threads, F&& body) {
    if (n_threads <= 1 || n <= 1 || size < (1 << 16)) {
        for (int64_t i = 0; i < n; ++i) body(i);
        return;
    }
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i);
}

}  // namespace

extern "C" {

const char* kvlm_isa() { return dot_isa(); }

int kvlm_supports(int32_t type) { return block_weights(type) != 0; }

// Rows `ids` (or 0..n_rows-1 when ids is null) of a quantized matrix with n_cols columns, into dst [n_rows][n_cols]
// as float32 or bfloat16.
int kvlm_dequantize(int32_t type, const uint8_t* weights, int64_t n_cols, const int64_t* ids, int64_t n_rows,
                    void* dst, int dst_bf16, int n_threads) {
    const int weights_per_block = block_weights(type);
    if (weights_per_block == 0) return UNSUPPORTED_TYPE;
    if (n_cols % weights_per_block) return BAD_SHAPE;
    with_type(type, [&](auto tag) {
        constexpr int TYPE = decltype(tag)::value;
#pragma omp parallel for num_threads(n_threads) schedule(static)
        for (int64_t r = 0; r < n_rows; ++r) {
            const int64_t source = ids ? ids[r] : r;
            const uint8_t* row = weights + source * row_bytes<TYPE>(n_cols);
            if (dst_bf16) dequantize_row<TYPE>(row, n_cols, static_cast<uint16_t*>(dst) + r * n_cols);
            else dequantize_row<TYPE>(row, n_cols, static_cast<float*>(dst) + r * n_cols);
        }
    });
    return OK;
}

// y [m][sum of part_rows] = x [m][k] times the transposed weights of each part (rows of k weights in the part's
// type), parts side by side: one quantization of x serves a stacked Q/K/V whose parts the file stores differently.
int kvlm_matmul(const void* x, int x_bf16, int64_t m, int64_t k, int n_parts, const int32_t* types,
                const uint8_t* const* weights, const int64_t* part_rows, void* y, int y_bf16, int n_threads) {
    int64_t n = 0;
    for (int p = 0; p < n_parts; ++p) {
        const int weights_per_block = block_weights(types[p]);
        if (weights_per_block == 0) return UNSUPPORTED_TYPE;
        if (k % weights_per_block) return BAD_SHAPE;
        n += part_rows[p];
    }
    if (k % 32) return BAD_SHAPE;
    // The activations quantized in blocks of 32 and/or 256, as the parts' formats read them; these buffers are the
    // calling thread's, shared with the pool's threads below.
    static thread_local QuantizedRows quantized[2];
    bool wanted[2] = {false, false};
    for (int p = 0; p < n_parts; ++p) wanted[block_weights(types[p]) == 256] = true;
    for (int f = 0; f < 2; ++f)
        if (wanted[f]) resize_for(quantized[f], f ? 256 : 32, m, k);
    QuantizedRows* act = quantized;
#pragma omp parallel num_threads(n_threads)
    {
        for (int f = 0; f < 2; ++f) {
            if (!wanted[f]) continue;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; ++r) quantize_row(x, x_bf16, r, k, act[f]);
        }
        // Each thread takes an equal share of the output columns, across parts.
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t begin = n * thread / threads, end = n * (thread + 1) / threads;
        int64_t part_start = 0;
        for (int p = 0; p < n_parts; ++p) {
            const int64_t j0 = std::max(begin, part_start) - part_start;
            const int64_t j1 = std::min(end, part_start + part_rows[p]) - part_start;
            if (j0 < j1)
                with_type(types[p], [&](auto tag) {
                    constexpr int TYPE = decltype(tag)::value;
                    product_rows<TYPE>(weights[p], k, j0, j1, act[is_k_quant<TYPE>()], y, y_bf16, n, part_start);
                });
            part_start += part_rows[p];
        }
    }
    return OK;
}

// Decode attention straight from the KV planes: token t's query heads [n_head][d] (q, float32 or bfloat16) over
// the cells cells[t][0 .. lengths[t]-1] of K and V ([cells][n_kv][d] of kv_type; q8_0 with scales), query heads
// g*j .. g*j+g-1 reading KV head j; out [n_tokens][n_head * d] in q's dtype. One task per (token, KV head).
int kvlm_decode_attention(const void* q, int q_bf16, int64_t n_tokens, int n_head, int n_kv, int d, float scale,
                          const void* k, const uint16_t* k_scales, const void* v, const uint16_t* v_scales,
                          int kv_type, const int64_t* cells, int64_t cells_stride, const int64_t* lengths,
                          void* out, int n_threads) {
    if (n_kv <= 0 || n_head % n_kv || (kv_type == KV_Q8_0 && d % 32) || kv_type < KV_F32 || kv_type > KV_Q8_0)
        return BAD_SHAPE;
    const KVPlane planes[2] = {{k, k_scales, kv_type, n_kv, d}, {v, v_scales, kv_type, n_kv, d}};
    const int group = n_head / n_kv;
    const int64_t tasks = n_tokens * n_kv;
    // One task per (token, KV head): always worth sharing out, whatever its length.
    for_rows(tasks, tasks << 16, n_threads, [&](int64_t task) {
        static thread_local std::vector<float> query, result, scores, row;
        query.resize(size_t(group) * d);
        result.resize(size_t(group) * d);
        const int64_t t = task / n_kv;
        const int head = int(task % n_kv);
        const int64_t first = (t * n_head + int64_t(head) * group) * d;
        load_floats(static_cast<const char*>(q) + first * (q_bf16 ? 2 : 4), q_bf16, int64_t(group) * d, query.data());
        attend_one_head(query.data(), group, d, scale, cells + t * cells_stride, lengths[t], planes[0], planes[1],
                        head, scores, row, result.data());
        for (int64_t i = 0; i < int64_t(group) * d; ++i) store_value(out, q_bf16, first + i, result[i]);
    });
    return OK;
}

// out = RMSNorm(x + residual) * weight over rows of n values; sum gets x + residual (residual null: plain norm).
int kvlm_rms_norm(const void* x, const void* residual, int bf16, int64_t rows, int64_t n, const void* weight,
                  float eps, void* out, void* sum, int n_threads) {
    for_rows(rows, rows * n, n_threads, [&](int64_t r) {
        static thread_local std::vector<float> values;
        rms_norm_row(x, residual, bf16, r, n, weight, eps, out, sum, values);
    });
    return OK;
}

// RoPE in place on x [n_tokens][token_stride] (each token's n_heads heads of d values first), with float32
// cos and sin [n_tokens][d].
int kvlm_rope(void* x, int bf16, int64_t n_tokens, int64_t token_stride, int n_heads, int d, const float* cos,
              const float* sin, int n_threads) {
    if (d % 2) return BAD_SHAPE;
    for_rows(n_tokens, n_tokens * n_heads * d, n_threads,
             [&](int64_t t) { rope_token(x, bf16, t * token_stride, n_heads, d, cos + t * d, sin + t * d); });
    return OK;
}

// out [rows][n] = act(gate) * up for gate_up [rows][2n]; gelu: the tanh approximation, else SiLU.
int kvlm_gated(const void* gate_up, int bf16, int64_t rows, int64_t n, int gelu, void* out, int n_threads) {
    for_rows(rows, rows * n, n_threads, [&](int64_t r) { gated_row(gate_up, bf16, r, n, gelu, out); });
    return OK;
}

}  // extern "C"
