// kvlm's native kernels, called through ctypes (see kvlm/kernels/native.py): products that read GGUF's quantized
// blocks as the file stores them, their exact dequantization, and a layer's small ops (layer_ops.h).
//
// Threads: OpenMP, linked against the runtime torch has already loaded (the same libgomp.so.1), so torch's ops
// and these share one pool of threads; the caller passes torch's thread count.
#include <omp.h>

#include <algorithm>
#include <string>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "decode_layer.h"
#include "delta_layer.h"
#include "delta_rule.h"
#include "dense.h"
#include "experts.h"
#include "layer_ops.h"
#include "products.h"
#include "recurrent.h"

using namespace kvlm;

namespace {

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

const char* kvlm_isa() {
#if defined(KVLM_BF16_SCORES)
    static const std::string isa = std::string(dot_isa()) + ", avx512 layer ops (bf16 scores)";
    return isa.c_str();
#elif defined(__AVX512F__)
    static const std::string isa = std::string(dot_isa()) + ", avx512 layer ops";
    return isa.c_str();
#else
    return dot_isa();
#endif
}

int kvlm_supports(int32_t type) { return block_weights(type) != 0; }

// gguf's grids of the grid formats (low_bit_formats.h), each entry's values as int8, in Grids' order.
void kvlm_set_grids(const int8_t* values, int64_t n) {
    if (n != int64_t(sizeof(Grids))) return;
    std::memcpy(&grids, values, sizeof(Grids));
    for (auto& entry : grids.iq1s)
        for (uint8_t& v : entry) v = uint8_t(v + 1);  // -1, 0, 1 as 0, 1, 2
    iq3s_pairs.fill();
}

int64_t kvlm_grids_size() { return int64_t(sizeof(Grids)); }

// Rows `ids` (or 0..n_rows-1 when ids is null) of a quantized matrix with n_cols columns, into dst [n_rows][n_cols]
// as float32 or bfloat16.
int kvlm_dequantize(int32_t type, const uint8_t* weights, int64_t n_cols, const int64_t* ids, int64_t n_rows,
                    void* dst, int dst_bf16, int n_threads, int interleaved) {
    const int weights_per_block = block_weights(type);
    if (weights_per_block == 0) return UNSUPPORTED_TYPE;
    if (n_cols % weights_per_block || (interleaved && !tiled_type(type))) return BAD_SHAPE;
    with_type(type, [&](auto tag) {
        constexpr int TYPE = decltype(tag)::value;
        const int64_t bytes = row_bytes<TYPE>(n_cols);
#pragma omp parallel for num_threads(n_threads) schedule(static)
        for (int64_t r = 0; r < n_rows; ++r) {
            static thread_local std::vector<uint8_t> file_row;
            const int64_t source = ids ? ids[r] : r;
            const uint8_t* row = weights + source * bytes;
            if constexpr (tiled_type(TYPE))
                if (interleaved) {  // back to the file's layout first
                    file_row.resize(size_t(bytes));
                    deinterleave_row<TYPE>(weights, n_cols / weights_per_block, source, file_row.data());
                    row = file_row.data();
                }
            if (dst_bf16) dequantize_row<TYPE>(row, n_cols, static_cast<uint16_t*>(dst) + r * n_cols);
            else dequantize_row<TYPE>(row, n_cols, static_cast<float*>(dst) + r * n_cols);
        }
    });
    return OK;
}

// Whether this build reads interleaved tiles (tiles.h): the loader then rearranges matrices with kvlm_interleave.
int kvlm_tiles() {
#if defined(KVLM_TILES)
    return 1;
#else
    return 0;
#endif
}

// Whether the products read matrices of this type in interleaved tiles (a tile layout and a build that reads tiles).
int kvlm_tiled(int32_t type) { return kvlm_tiles() && tiled_type(type); }

// The most activation rows a pass over a tile can multiply in this build (0 without tiles).
int kvlm_max_tile_pass_rows() {
#if defined(KVLM_TILES)
    return MAX_PASS_ROWS;
#else
    return 0;
#endif
}

// Activation rows a pass over a tile of this type multiplies (1 .. kvlm_max_tile_pass_rows(); 0: the build's
// default, dot.h), for bench.tile_passes and the test that a row's bits do not depend on it. Not to be called while
// products run.
int kvlm_set_tile_pass_rows(int32_t type, int rows) {
    if (!kvlm_tiled(type)) return UNSUPPORTED_TYPE;
    if (rows < 0 || rows > kvlm_max_tile_pass_rows()) return BAD_SHAPE;
    tile_pass_rows_set[type] = rows;
    return OK;
}

// The activation rows a pass over a tile of this type multiplies now.
int kvlm_tile_pass_rows(int32_t type) { return kvlm_tiled(type) ? tile_pass_rows(type) : 0; }

// Rearranges a matrix of n_rows (a multiple of 8) rows of n_cols into interleaved tiles, in place.
int kvlm_interleave(int32_t type, uint8_t* weights, int64_t n_rows, int64_t n_cols, int n_threads) {
    const int weights_per_block = block_weights(type);
    if (weights_per_block == 0) return UNSUPPORTED_TYPE;
    if (n_cols % weights_per_block || n_rows % TILE_ROWS || !tiled_type(type)) return BAD_SHAPE;
    with_type(type, [&](auto tag) {
        constexpr int TYPE = decltype(tag)::value;
        if constexpr (tiled_type(TYPE)) {
            const int64_t tile_bytes = TILE_ROWS * row_bytes<TYPE>(n_cols);
#pragma omp parallel for num_threads(n_threads) schedule(static)
            for (int64_t t = 0; t < n_rows / TILE_ROWS; ++t) {
                static thread_local std::vector<uint8_t> scratch;
                scratch.resize(size_t(tile_bytes));
                interleave_tile<TYPE>(weights + t * tile_bytes, n_cols / weights_per_block, scratch.data());
            }
        }
    });
    return OK;
}

// y [m][sum of part_rows] = x [m][k] times the transposed weights of each part (rows of k weights in the part's
// type, interleaved in tiles of 8 rows where `interleaved` says so), parts side by side: one quantization of x
// serves a stacked Q/K/V whose parts the file stores differently.
int kvlm_matmul(const void* x, int x_bf16, int64_t m, int64_t k, int n_parts, const int32_t* types,
                const uint8_t* const* weights, const int64_t* part_rows, const int32_t* interleaved, void* y,
                int y_bf16, int n_threads) {
    const Matrix matrix{n_parts, types, weights, part_rows, interleaved, k};
    const int status = check_matrix(matrix);
    if (status != OK) return status;
    static thread_local QuantizedRows quantized[2];
    QuantizedRows* act = quantized;  // the calling thread's (named here: in the team, `quantized` is each thread's own)
#pragma omp parallel num_threads(n_threads)
    product_in_team(matrix, x, x_bf16, m, act, y, y_bf16);
    return OK;
}

// Attention straight from the KV planes (attention.h): token t's query heads [n_head][d] (q, float32 or bfloat16)
// over the cells cells[offsets[t]] .. cells[offsets[t] + lengths[t] - 1] of K and V ([cells][n_kv][d] of kv_type;
// q8_0 with scales), query heads g*j .. g*j+g-1 reading KV head j; out [n_tokens][n_head * d] in q's dtype. sinks:
// [n_head] logits joining each head's softmax denominator (gpt-oss), or null.
int kvlm_attention(const void* q, int q_bf16, int64_t n_tokens, int n_head, int n_kv, int d, float scale,
                   const void* k, const uint16_t* k_scales, const void* v, const uint16_t* v_scales, int kv_type,
                   const int64_t* cells, const int64_t* offsets, const int64_t* lengths, const float* sinks, void* out,
                   int n_threads) {
    if (n_kv <= 0 || n_head % n_kv || d % HEAD_DIM_STEP || kv_type < KV_F32 || kv_type > KV_Q8_0) return BAD_SHAPE;
    const int64_t width = int64_t(n_head) * d;
    const AttentionWork work{q, q_bf16 != 0, width, n_tokens, n_head, n_kv, d, scale, cells, offsets, lengths,
                             {k, k_scales, kv_type, n_kv, d}, {v, v_scales, kv_type, n_kv, d}, out, width, sinks};
    static thread_local std::vector<float> partials;
    std::vector<float>* shared = &partials;  // the calling thread's (in the team, `partials` is each thread's own)
#pragma omp parallel num_threads(n_threads)
    attention_in_team(work, *shared);
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

// RoPE in place on x [n_tokens][token_stride] (each token's n_heads heads of d values first) over each head's first
// `rotated` values (all d, or fewer: partial RoPE), with float32 cos and sin [n_tokens][rotated].
int kvlm_rope(void* x, int bf16, int64_t n_tokens, int64_t token_stride, int n_heads, int d, int rotated,
              const float* cos, const float* sin, int n_threads) {
    if (rotated % 2 || rotated > d || rotated < 0) return BAD_SHAPE;
    for_rows(n_tokens, n_tokens * n_heads * d, n_threads, [&](int64_t t) {
        rope_token(x, bf16, t * token_stride, n_heads, d, rotated, cos + t * rotated, sin + t * rotated);
    });
    return OK;
}

// QK-norm in place on x [n_tokens][token_stride] (each token's n_heads heads of d values first), each head with its
// own weight of d values (weight [n_heads][d]).
int kvlm_head_norm(void* x, int bf16, int64_t n_tokens, int64_t token_stride, int n_heads, int d, const void* weight,
                   float eps, int n_threads) {
    for_rows(n_tokens, n_tokens * n_heads * d, n_threads, [&](int64_t t) {
        static thread_local std::vector<float> values;
        head_norm_token(x, bf16, t * token_stride, n_heads, d, weight, eps, values);
    });
    return OK;
}

// out [rows][n] = act(gate) * up for gate_up [rows][2n]; gelu: the tanh approximation, else SiLU.
int kvlm_gated(const void* gate_up, int bf16, int64_t rows, int64_t n, int gelu, void* out, int n_threads) {
    for_rows(rows, rows * n, n_threads, [&](int64_t r) { gated_row(gate_up, bf16, r, n, gelu, out); });
    return OK;
}

// out [rows][n] = x * sigmoid(gate), gate float32 [rows][gate_cols]: gate_cols n (elementwise) or 1 (per row).
int kvlm_sigmoid_gate(const void* x, int bf16, int64_t rows, int64_t n, const float* gate, int64_t gate_cols, void* out,
                      int n_threads) {
    if (gate_cols != n && gate_cols != 1) return BAD_SHAPE;
    for_rows(rows, rows * n, n_threads, [&](int64_t r) { sigmoid_gate_row(x, bf16, r, n, gate, gate_cols, out); });
    return OK;
}

// logits [rows][n] (float32) = cap * tanh(logits / cap), in place (shared out by spans of 4096: one row of a large
// vocabulary is work for every thread).
int kvlm_softcap(float* logits, int64_t rows, int64_t n, float cap, int n_threads) {
    constexpr int64_t SPAN = 4096;
    const int64_t spans = (n + SPAN - 1) / SPAN;
    for_rows(rows * spans, rows * n, n_threads, [&](int64_t task) {
        const int64_t first = task % spans * SPAN;
        softcap_values(logits + task / spans * n + first, std::min(SPAN, n - first), cap);
    });
    return OK;
}

// Each token's k experts and their weights from its router logits [n_tokens][n_expert] (float32; bias [n_expert] or
// null): route_token per token; ids [n_tokens][k] int32, weights [n_tokens][k] float32.
int kvlm_route(const float* logits, const float* bias, int64_t n_tokens, int n_expert, int k, int normalize,
               int32_t* ids, float* weights, int n_threads) {
    if (n_expert < 1 || k < 1 || k > n_expert) return BAD_SHAPE;
    // a token's work: an exp per logit and k scans of them (weighed as ~16 values each against for_rows' threshold)
    for_rows(n_tokens, n_tokens * n_expert * 16, n_threads, [&](int64_t t) {
        static thread_local std::vector<float> values;
        values.resize(size_t(n_expert));
        route_token(logits + t * n_expert, bias, n_expert, k, normalize, ids + t * k, weights + t * k, values.data());
    });
    return OK;
}

// Qwen3.5's gated delta rule for one token (delta_rule.h) over n_heads_total independent heads (n_seq * H), all
// float32 and contiguous: state and new_state [n_heads_total][dk][dv], q and k [n_heads_total][dk], v and out
// [n_heads_total][dv], g (log decays) and beta [n_heads_total].
int kvlm_delta_step(const float* state, float* new_state, const float* q, const float* k, const float* v,
                    const float* g, const float* beta, float* out, int64_t n_heads_total, int dk, int dv,
                    int n_threads) {
    if (n_heads_total < 0 || dk <= 0 || dv <= 0) return BAD_SHAPE;
    const int64_t head = int64_t(dk) * dv;
    for_rows(n_heads_total, n_heads_total * head, n_threads, [&](int64_t h) {
        static thread_local std::vector<float> reads;
        reads.resize(size_t(2 * dv));
        delta_step_head(state + h * head, new_state + h * head, q + h * dk, k + h * dk, v + h * dv, g[h], beta[h],
                        out + h * dv, dk, dv, reads.data());
    });
    return OK;
}

// The gated delta rule over n_tokens tokens of each of n_seq sequences, token by token (delta_rule.h's
// delta_rule_head: one token gives kvlm_delta_step's bits), all float32 and contiguous: q and k
// [n_seq][n_tokens][n_heads][dk], v and out [n_seq][n_tokens][n_heads][dv], g (log decays) and beta
// [n_seq][n_tokens][n_heads], state and new_state [n_seq][n_heads][dk][dv] (state is left as it was).
int kvlm_delta_rule(const float* state, float* new_state, const float* q, const float* k, const float* v,
                    const float* g, const float* beta, float* out, int64_t n_seq, int64_t n_tokens, int n_heads,
                    int dk, int dv, int n_threads) {
    if (n_seq < 0 || n_tokens <= 0 || n_heads <= 0 || dk <= 0 || dv <= 0) return BAD_SHAPE;
    const int64_t head = int64_t(dk) * dv;
    for_rows(n_seq * n_heads, n_seq * n_tokens * n_heads * head, n_threads, [&](int64_t i) {
        static thread_local std::vector<float> reads;
        reads.resize(size_t(2 * dv));
        const int64_t s = i / n_heads, first = s * n_tokens * n_heads + i % n_heads;  // token 0's (s, h)
        const DeltaTokens tokens{q + first * dk, k + first * dk, v + first * dv, g + first, beta + first,
                                 out + first * dv, int64_t(n_heads) * dk, int64_t(n_heads) * dv, n_heads,
                                 int64_t(n_heads) * dv};
        delta_rule_head(state + i * head, new_state + i * head, tokens, n_tokens, dk, dv, reads.data());
    });
    return OK;
}

// Depthwise causal convolution (recurrent.h) of x [n_seq][n_tokens][channels] (token rows x_stride values apart)
// by weight [channels][taps] after each sequence's last taps - 1 inputs, state [n_seq][channels][taps - 1]; plus
// bias [channels] (or null), then SiLU where `silu` says. out [n_seq][n_tokens][channels]. states[s]: sequence s's
// [channels][taps - 1]; new_states[s]: where its new state goes (may be states[s]). x, out and the states float32 or
// bfloat16 as their flags say, weight and bias float32.
int kvlm_causal_conv(const void* x, int x_bf16, int64_t x_stride, int64_t n_seq, int64_t n_tokens, int64_t channels,
                     const void* const* states, int state_bf16, const float* weight, int taps, const float* bias,
                     int silu, void* out, int out_bf16, void* const* new_states, int n_threads) {
    if (n_seq < 0 || n_tokens <= 0 || channels <= 0 || taps <= 0 || x_stride < channels) return BAD_SHAPE;
    const CausalConv conv{{x, x_bf16 != 0, x_stride}, n_tokens, channels, states, state_bf16 != 0, weight, taps,
                          bias, silu != 0, out, out_bf16 != 0, new_states};
    const int64_t blocks = (channels + CONV_CHANNELS - 1) / CONV_CHANNELS;
    for_rows(n_seq * blocks, n_seq * n_tokens * channels * taps, n_threads, [&](int64_t i) {
        static thread_local std::vector<float> scratch;
        causal_conv_channels(conv, i / blocks, i % blocks * CONV_CHANNELS, scratch);
    });
    return OK;
}

// Mamba2's selective scan and gated RMS norm (recurrent.h) after the convolution: xbc [n_seq][n_tokens][H*P + 2*G*N]
// float32 (x, B, C after the SiLU), z [..][H*P] and raw dt [..][H] (rows z_stride and dt_stride values apart, both
// float32 or bfloat16 as `bf16` says), states[s] and new_states[s] sequence s's [H][P][N] float32 (may be the same);
// out [n_seq][n_tokens][H*P] in z's dtype. dt_bias, A_log, D [H] and norm [H*P] float32; dt is clamped to [dt_min, dt_max].
int kvlm_mamba2_scan(const float* xbc, const void* z, int64_t z_stride, const void* dt, int64_t dt_stride, int bf16,
                     int64_t n_seq, int64_t n_tokens, int n_heads, int head_dim, int d_state, int n_groups,
                     const float* dt_bias, const float* A_log, const float* D, const float* norm, float dt_min,
                     float dt_max, float eps, const float* const* states, float* const* new_states, void* out,
                     int n_threads) {
    if (n_seq < 0 || n_tokens <= 0 || n_heads <= 0 || head_dim <= 0 || d_state <= 0 || n_groups <= 0 ||
        n_heads % n_groups || z_stride < int64_t(n_heads) * head_dim || dt_stride < n_heads)
        return BAD_SHAPE;
    const Mamba2Scan scan{xbc, {z, bf16 != 0, z_stride}, {dt, bf16 != 0, dt_stride}, n_tokens, n_heads, head_dim,
                          d_state, n_groups, dt_bias, A_log, D, norm, dt_min, dt_max, eps, states, new_states};
    const int64_t rows = n_seq * n_tokens, d_inner = scan.d_inner();
    static thread_local std::vector<float> scanned;
    scanned.resize(size_t(rows * d_inner));
    float* y = scanned.data();  // the calling thread's (in the team, `scanned` is each thread's own)
    for_rows(n_seq * n_heads, rows * d_inner * d_state, n_threads,
             [&](int64_t i) { mamba2_scan_head(scan, i / n_heads, int(i % n_heads), y); });
    for_rows(rows * n_groups, rows * d_inner, n_threads, [&](int64_t i) {
        static thread_local std::vector<float> values;
        mamba2_gated_norm(scan, i / n_groups, int(i % n_groups), y, out, values);
    });
    return OK;
}

// Qwen3.5's gated delta net between its projections, after the convolution (recurrent.h): mixed
// [n_seq][n_tokens][2*Hk*Dk + Hv*Dv] float32 (q, k, v after the SiLU), z [..][Hv*Dv], b and a [..][Hv] (rows
// z_stride, b_stride and a_stride values apart, all float32 or bfloat16 as `bf16` says), states[s] and new_states[s]
// sequence s's [Hv][Dk][Dv] float32 (may be the same); out [n_seq][n_tokens][Hv*Dv] in z's dtype. dt_bias and A [Hv], norm [Dv] float32.
int kvlm_gated_delta_net(const float* mixed, const void* z, int64_t z_stride, const void* b, int64_t b_stride,
                         const void* a, int64_t a_stride, int bf16, int64_t n_seq, int64_t n_tokens, int n_k_heads,
                         int n_v_heads, int dk, int dv, int v_heads_tiled, const float* dt_bias, const float* A,
                         const float* norm, float eps, const float* const* states, float* const* new_states,
                         void* out, int n_threads) {
    if (n_seq < 0 || n_tokens <= 0 || n_k_heads <= 0 || n_v_heads <= 0 || n_v_heads % n_k_heads || dk <= 0 || dv <= 0 ||
        z_stride < int64_t(n_v_heads) * dv || b_stride < n_v_heads || a_stride < n_v_heads)
        return BAD_SHAPE;
    const DeltaNet net{mixed, {z, bf16 != 0, z_stride}, {b, bf16 != 0, b_stride}, {a, bf16 != 0, a_stride}, n_tokens,
                       n_k_heads, n_v_heads, dk, dv, v_heads_tiled != 0, dt_bias, A, norm, eps, states, new_states,
                       out};
    for_rows(n_seq * n_v_heads, n_seq * n_tokens * n_v_heads * dk * dv, n_threads, [&](int64_t i) {
        static thread_local DeltaNetScratch scratch;
        delta_net_head(net, i / n_v_heads, int(i % n_v_heads), scratch);
    });
    return OK;
}

// One decoder layer for decode tokens (decode_layer.h): x [n_tokens][n_embd] updated in place, the tokens' K and V
// written to their cells of this layer (`layer`, in the store the step names); a layer of experts (no MLP) leaves
// the input of its experts in normed_out; a layer with a per-layer input reads its vectors from per_layer (token t's
// at per_layer + t * per_layer_stride values).
int kvlm_decode_layer(const LayerSpec* spec, const StepSpec* step, int layer, void* x, void* normed_out,
                      const void* per_layer, int64_t per_layer_stride, int n_threads) {
    const LayerSpec& L = *spec;
    for (const Matrix* w : {&L.qkv, &L.output, &L.gate_up, &L.down, &L.per_layer_gate, &L.per_layer_proj}) {
        const int status = check_matrix(*w);
        if (status != OK) return status;
    }
    if (L.n_kv <= 0 || L.n_head % L.n_kv || L.d % HEAD_DIM_STEP || (step->kv_type == KV_Q8_0 && L.d % 32) ||
        step->kv_type < KV_F32 || step->kv_type > KV_Q8_0)
        return BAD_SHAPE;
    if (L.gate_up.n_parts == 0 && (normed_out == nullptr || L.per_layer_gate.n_parts || L.output_scale))
        return BAD_SHAPE;  // a layer of experts ends before them: nothing after its MLP runs here
    if (L.per_layer_gate.n_parts && (per_layer == nullptr || L.per_layer_proj.n_parts == 0 || !L.per_layer_norm))
        return BAD_SHAPE;
    if (L.rope_dims % 2 || L.rope_dims < 0 || L.rope_dims > L.d || (L.output_gate && (L.d > 512 || L.qkv_bias || L.qk_norm_whole)))
        return BAD_SHAPE;
    decode_layer(L, *step, layer, x, normed_out, {per_layer, per_layer_stride}, n_threads);
    return OK;
}

// A mixture-of-experts block (experts.h): out [n_tokens][n_embd] = each token's weighted sum of its n_used experts
// (ids, weights [n_tokens][n_used]) applied to x [n_tokens][n_embd], in x's dtype.
int kvlm_experts(const ExpertsSpec* spec, const void* x, int bf16, int64_t n_tokens, int n_used, const int32_t* ids,
                 const float* weights, void* out, int n_threads) {
    const int status = check_experts(*spec);
    if (status != OK) return status;
    static thread_local Routing routing;
    if (n_tokens <= 0 || n_used <= 0 || !routing.build(ids, n_tokens * n_used, n_used, spec->n_expert)) return BAD_SHAPE;
    experts_ffn(*spec, x, bf16 != 0, n_tokens, n_used, routing, weights, out, n_threads);
    return OK;
}

// Dense weights w [n][k] (float32, float16 or bfloat16: `type` 0, 1, 2) rearranged into `packed` (as many bytes)
// in the layout kvlm_dense_matmul reads (dense.h).
int kvlm_dense_pack(const void* w, int type, int64_t n, int64_t k, void* packed, int n_threads) {
    return pack_dense(w, type, n, k, packed, n_threads);
}

// y [m][n] = x [m][k] times the transpose of weights packed by kvlm_dense_pack, x and y float32 or bfloat16: each
// output row the same bits whatever the other rows and the number of threads (dense.h).
int kvlm_dense_matmul(const void* x, int x_bf16, int64_t m, int64_t k, const void* packed, int type, int64_t n,
                      void* y, int y_bf16, int n_threads) {
    return dense_product(x, x_bf16 != 0, m, k, packed, type, n, y, y_bf16 != 0, n_threads);
}

// One Gated DeltaNet layer for n_seq sequences of n_tokens tokens each (delta_layer.h): x [n_seq * n_tokens][n_embd]
// updated in place; each sequence's convolution and delta-rule states read at conv_sources[s] and sources[s] and
// their new values written at conv_targets[s] and targets[s] (float32 [conv_dim][taps - 1] and [Hv][Dk][Dv]). A layer
// of experts (no MLP) leaves the input of its experts in normed_out.
int kvlm_delta_layer(const LayerSpec* spec, const DeltaMixer* mixer, int64_t n_seq, int64_t n_tokens,
                     const void* const* conv_sources, void* const* conv_targets, const float* const* sources,
                     float* const* targets, void* x, void* normed_out, int n_threads) {
    const LayerSpec& L = *spec;
    const DeltaMixer& M = *mixer;
    for (const Matrix* w : {&M.in_proj, &M.out_proj, &L.gate_up, &L.down}) {
        const int status = check_matrix(*w);
        if (status != OK) return status;
    }
    if (n_seq <= 0 || n_tokens <= 0 || M.taps <= 0 || M.n_k_heads <= 0 || M.n_v_heads <= 0 ||
        M.n_v_heads % M.n_k_heads || M.dk <= 0 || M.dv <= 0 || M.in_proj.k != L.n_embd ||
        M.in_proj.n_rows() != M.projected() || M.out_proj.k != M.value_dim() || M.out_proj.n_rows() != L.n_embd ||
        (L.gate_up.n_parts == 0 && normed_out == nullptr))
        return BAD_SHAPE;
    delta_layer(L, M, n_seq, n_tokens, {conv_sources, conv_targets, sources, targets}, x, normed_out, n_threads);
    return OK;
}

// The fused layers' time by phase (decode_layer.h): `on` starts (or stops) summing; out gets the sums so far, in
// seconds: products, attention, other.
void kvlm_layer_times(int on, double* out) {
    layer_times.on = on != 0;
    if (out) {
        out[0] = layer_times.products;
        out[1] = layer_times.attention;
        out[2] = layer_times.other;
    }
}

}  // extern "C"
