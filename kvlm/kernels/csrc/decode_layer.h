// A whole decoder layer for decode tokens in one call: what the model's Python runs as a dozen calls (a norm, the
// Q/K/V product, bias, QK-norm and RoPE, the K/V write, attention, the output product, the residual add and the
// next norm, gate/up, the activation, down and the last add) runs here inside one OpenMP team, its phases
// separated by barriers. Each phase computes what the separate native ops compute (layer_ops.h, products.h), in
// the same activation dtype at the same points, so the layer's result is theirs.
#pragma once

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "layer_ops.h"
#include "products.h"

namespace kvlm {

// What stays the same from step to step: the layer's shapes, weights and norms (vectors in the activation dtype).
struct LayerSpec {
    int bf16;                  // activations bfloat16, else float32
    int gelu;                  // the gated activation: GELU (tanh), else SiLU
    int qk_norm_whole;         // the QK-norm over each token's whole Q, then whole K (OLMoE; no q/k/v bias), not per head
    int n_head, n_kv, d;
    int64_t n_embd, n_ff;
    float eps, query_scale, attention_scale;
    const void* attn_norm;     // [n_embd]
    const void* qkv_bias;      // [(n_head + 2 n_kv) d] or null
    const void* qk_norm;       // [n_head + n_kv][d] or null: each Q head's, then each K head's (whole: the same values)
    const void* post_attention_norm;  // [n_embd] or null (sandwich norms)
    const void* ffn_norm;      // [n_embd]
    const void* post_ffw_norm; // [n_embd] or null
    const void* output_bias;   // [n_embd] or null: the attention output projection's bias (gpt-oss)
    const float* sinks;        // [n_head] float32 attention sinks' logits (gpt-oss), or null
    Matrix qkv, output, gate_up, down;
    int computes_kv;           // the layer computes its K/V heads; else it reads those another layer wrote (Gemma 4)
    int v_from_k;              // V is K as projected, before K's norm: no V heads in the product (Gemma 4's full layers)
    int value_norm;            // V heads through a weightless RMSNorm before they are written (Gemma 4)
    // The per-layer input's term after the MLP (Gemma 4): x += post_norm(proj(gelu(gate(x)) * the token's vector)),
    // where per_layer_gate has parts; then x *= output_scale where given.
    int64_t per_layer_width;
    Matrix per_layer_gate, per_layer_proj;
    const void* per_layer_norm;  // [n_embd]
    const void* output_scale;    // [1] or null
    int output_gate;           // each query head followed by as many gate values: out = attention x sigmoid(gate) (Qwen3.5)
    int rope_dims;             // RoPE over each head's first rope_dims values (d: all of them)

    // The heads the Q/K/V product gives each token: its queries (each with its gate), the K heads it computes, then
    // as many V heads.
    int k_heads() const { return computes_kv ? n_kv : 0; }
    int v_heads() const { return computes_kv && !v_from_k ? n_kv : 0; }
    int qkv_heads() const { return n_head + k_heads() + v_heads(); }
    // Where head h of a token's row of the product starts, and the row's width.
    int64_t head_at(int h) const {
        const int64_t query = int64_t(output_gate ? 2 : 1) * d;
        return h < n_head ? h * query : n_head * query + int64_t(h - n_head) * d;
    }
    int64_t qkv_width() const { return head_at(qkv_heads()); }
};

// What a step brings: its tokens' RoPE, the cells they write and read, and the KV store's planes.
struct StepSpec {
    int64_t n_tokens;
    const float* cos;          // [n_tokens][d]
    const float* sin;
    const int64_t* write_cells;  // [n_tokens]: where each token's K and V go
    const int64_t* cells;      // the cells each token reads (its own included): cells[offsets[t]] onwards ...
    const int64_t* offsets;
    const int64_t* lengths;    // ... lengths[t] of them
    void* k;                   // the store's planes, every layer: [n_layer][n_cells][n_kv][d] of kv_type
    uint16_t* k_scales;        // q8_0: [n_layer][n_cells][n_kv][d / 32] f16
    void* v;
    uint16_t* v_scales;
    int kv_type;
    int64_t n_cells;
};

inline uint16_t float_to_f16(float f) {
#if defined(__F16C__)
    return uint16_t(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
    // Round to nearest even, as torch's .to(torch.float16).
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint32_t sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
    if (magnitude >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds beyond the largest f16: infinity
    if (magnitude < 0x38800000u) {  // subnormal in f16 (or zero): round the value times 2^24 to an integer
        float scaled;
        const uint32_t abs_bits = magnitude;
        std::memcpy(&scaled, &abs_bits, 4);
        return uint16_t(sign | uint32_t(std::nearbyint(scaled * 16777216.0f)));
    }
    const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u) - (112u << 23);
    return uint16_t(sign | (rounded >> 13));
#endif
}

// One token's K or V head (d values) into its cell, converted as the KV store converts (kvlm.memory.kv_store):
// float types rounded to nearest even; q8_0 per 32 values, step max|x| / 127, levels round(x / step).
inline void write_kv_row(void* plane, uint16_t* scales, int type, int64_t row, int d, const float* values) {
    const int64_t at = row * d;
    switch (type) {
        case KV_F32: std::copy_n(values, d, static_cast<float*>(plane) + at); break;
        case KV_F16:
            for (int i = 0; i < d; ++i) static_cast<uint16_t*>(plane)[at + i] = float_to_f16(values[i]);
            break;
        case KV_BF16:
            for (int i = 0; i < d; ++i) static_cast<uint16_t*>(plane)[at + i] = float_to_bf16(values[i]);
            break;
        default:
            for (int b = 0; b < d / 32; ++b) {
                float amax = 0.0f;
                for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(values[32 * b + i]));
                const float step = amax / 127.0f, divisor = std::fmax(step, 1e-30f);
                for (int i = 0; i < 32; ++i) {
                    const float level = std::fmin(std::fmax(std::nearbyint(values[32 * b + i] / divisor), -127.0f), 127.0f);
                    static_cast<int8_t*>(plane)[at + 32 * b + i] = int8_t(level);
                }
                scales[at / 32 + b] = float_to_f16(step);
            }
    }
}

// One layer's K and V planes in the store, to write to.
struct LayerPlanes {
    void* data[2];           // K, V: [n_cells][n_kv][d]
    uint16_t* scales[2];     // q8_0: [n_cells][n_kv][d / 32]
    int type;

    LayerPlanes(const StepSpec& S, int layer, int64_t row_values) {  // row_values: n_kv * d
        const int element = S.kv_type == KV_F32 ? 4 : S.kv_type == KV_Q8_0 ? 1 : 2;
        const int64_t before = int64_t(layer) * S.n_cells * row_values;  // values of the layers before this one
        data[0] = static_cast<char*>(S.k) + before * element;
        data[1] = static_cast<char*>(S.v) + before * element;
        scales[0] = S.k_scales ? S.k_scales + before / 32 : nullptr;
        scales[1] = S.v_scales ? S.v_scales + before / 32 : nullptr;
        type = S.kv_type;
    }

    KVPlane read(int which, int n_kv, int d) const { return {data[which], scales[which], type, n_kv, d}; }
};

// A token's V head (d values, as the activation dtype holds them) into its cell: through the weightless RMSNorm first
// where the layer has one (rms_norm_row's arithmetic, its weight 1; rounded as its output is).
inline void write_v_head(const LayerSpec& L, const StepSpec& S, const LayerPlanes& planes, int64_t t, int head,
                         std::vector<float>& values) {
    const int d = L.d;
    if (L.value_norm) {
        const float inverse = 1.0f / std::sqrt(dot(values.data(), values.data(), d) / float(d) + L.eps);
        for (int i = 0; i < d; ++i) values[i] = rounded(L.bf16, values[i] * inverse);
    }
    write_kv_row(planes.data[1], planes.scales[1], planes.type, S.write_cells[t] * L.n_kv + head, d, values.data());
}

// Head h of token t in the stacked Q/K/V row: bias, QK-norm (Q and K heads), RoPE (Q and K), the query scale (Q);
// K and V heads are then written to the token's cell (a layer whose V is K takes it from the K head before its norm).
// Each step rounds to the activation dtype, as torch's ops do. A layer with an output gate puts each finished query
// head into `queries` [T][n_head * d] (its product's rows hold each query beside its gate).
inline void finish_head(const LayerSpec& L, const StepSpec& S, const LayerPlanes& planes, void* qkv, int64_t t,
                        int h, void* queries, std::vector<float>& values) {
    const bool bf16 = L.bf16;
    const int d = L.d, n_qk = L.n_head + L.k_heads();
    const int64_t at = t * L.qkv_width() + L.head_at(h);
    values.resize(d);
    load_floats(static_cast<char*>(qkv) + at * (bf16 ? 2 : 4), bf16, d, values.data());
    if (L.qkv_bias)
        for (int i = 0; i < d; ++i) values[i] = rounded(bf16, values[i] + load_value(L.qkv_bias, bf16, int64_t(h) * d + i));
    for (int i = 0; i < d; ++i) store_value(qkv, bf16, at + i, values[i]);
    if (h >= n_qk) return write_v_head(L, S, planes, t, h - n_qk, values);
    if (L.v_from_k && h >= L.n_head) {
        static thread_local std::vector<float> v_values;
        v_values.assign(values.begin(), values.end());
        write_v_head(L, S, planes, t, h - L.n_head, v_values);
    }
    if (L.qk_norm && !L.qk_norm_whole) {
        const char* weight = static_cast<const char*>(L.qk_norm) + int64_t(h) * d * (bf16 ? 2 : 4);
        head_norm_token(qkv, bf16, at, 1, d, weight, L.eps, values);
    }
    rope_token(qkv, bf16, at, 1, d, L.rope_dims, S.cos + t * L.rope_dims, S.sin + t * L.rope_dims);
    load_floats(static_cast<char*>(qkv) + at * (bf16 ? 2 : 4), bf16, d, values.data());
    if (h < L.n_head) {
        if (L.query_scale != 1.0f)
            for (int i = 0; i < d; ++i) store_value(qkv, bf16, at + i, values[i] * L.query_scale);
        if (L.output_gate)
            std::memcpy(static_cast<char*>(queries) + (t * L.n_head + h) * d * (bf16 ? 2 : 4),
                        static_cast<char*>(qkv) + at * (bf16 ? 2 : 4), size_t(d) * (bf16 ? 2 : 4));
        return;
    }
    write_kv_row(planes.data[0], planes.scales[0], planes.type, S.write_cells[t] * L.n_kv + h - L.n_head, d,
                 values.data());
}

// out[i] *= sigmoid(gate[i]) for one head's d values of the activation dtype (x / (1 + exp(-gate)), rounded once).
inline void gate_head(const LayerSpec& L, void* out, const void* gate) {
    float values[512], gates[512];  // d <= 512 (the layer's check)
    load_floats(out, L.bf16, L.d, values);
    load_floats(gate, L.bf16, L.d, gates);
    for (int i = 0; i < L.d; ++i) values[i] = values[i] / (1.0f + exp_float(-gates[i]));
    store_floats(out, L.bf16, L.d, values);
}

// Where the fused layers' time goes (for bench/profile_step.py), summed while `on`: the weight products, attention,
// and the rest (norms, bias, RoPE, the K/V write, the activation, the adds), timed by the team's first thread at
// the barriers between phases.
struct LayerTimes {
    bool on = false;
    double products = 0.0, attention = 0.0, other = 0.0;
};
inline LayerTimes layer_times;

// The phase that just ended (on the team's first thread, when timing is on).
struct PhaseClock {
    double last = 0.0;
    void start() {
        if (layer_times.on && omp_get_thread_num() == 0) last = omp_get_wtime();
    }
    void lap(double LayerTimes::*bucket) {
        if (!layer_times.on || omp_get_thread_num() != 0) return;
        const double now = omp_get_wtime();
        layer_times.*bucket += now - last;
        last = now;
    }
};

// Buffers a layer's phases share, carved out of one block: the calling thread's, reused from call to call (named by
// pointer before the team starts: inside it, a thread_local name is each thread's own); and the quantized
// activations of its products.
struct LayerBuffers {
    std::vector<uint8_t> memory;
    QuantizedRows quantized[2];

    // out[i]: bytes[i] bytes, each buffer 64-byte aligned within the block.
    template <size_t N> void carve(const int64_t (&bytes)[N], void* (&out)[N]) {
        int64_t total = 0;
        for (int64_t size : bytes) total += (size + 63) / 64 * 64;
        memory.resize(size_t(total));
        char* next = reinterpret_cast<char*>(memory.data());
        for (size_t i = 0; i < N; ++i) {
            out[i] = next;
            next += (bytes[i] + 63) / 64 * 64;
        }
    }
};

// Each thread's part in a layer's team: its phase clock, and the products (every thread, then all wait).
struct LayerTeam {
    bool bf16;
    int64_t T;            // token rows
    QuantizedRows* act;   // the products' quantized activations, shared by the team
    PhaseClock clock;

    void multiply(const Matrix& w, const void* in, void* out) {
        product_in_team(w, in, bf16, T, act, out, bf16);
#pragma omp barrier
        clock.lap(&LayerTimes::products);
    }

    // The layer's first op: each token's row of x RMS-normed by attn_norm into normed.
    void first_norm(const LayerSpec& L, void* x, void* normed, std::vector<float>& values) {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) rms_norm_row(x, nullptr, bf16, t, L.n_embd, L.attn_norm, L.eps, normed, nullptr, values);
        clock.lap(&LayerTimes::other);
    }
};

constexpr int64_t GATED_SPAN = 512;  // the gated activation's columns per task

// Inside the team, after the residual add that left the FFN norm's output in `normed`: gate_up, the gated
// activation, down, the post-FFW norm where the layer has one, and x += the result (rounded to the activation dtype,
// as torch's add). A layer of experts (gate_up of no parts) copies `normed` to normed_out instead: its experts run
// after the call, on that.
inline void mlp_in_team(const LayerSpec& L, LayerTeam& team, void* x, const void* normed, void* gate_up, void* gated,
                        void* h, void* normed_out, std::vector<float>& values) {
    const bool bf16 = L.bf16;
    const int64_t T = team.T;
    const int64_t element = bf16 ? 2 : 4;
    if (L.gate_up.n_parts == 0) {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t)
            std::memcpy(static_cast<char*>(normed_out) + t * L.n_embd * element,
                        static_cast<const char*>(normed) + t * L.n_embd * element, size_t(L.n_embd * element));
    } else {
        team.multiply(L.gate_up, normed, gate_up);
        const int64_t spans = (L.n_ff + GATED_SPAN - 1) / GATED_SPAN;  // one token's row is work for every thread
#pragma omp for schedule(static)
        for (int64_t task = 0; task < T * spans; ++task) {
            const int64_t first = task % spans * GATED_SPAN;
            gated_row(gate_up, bf16, task / spans, L.n_ff, L.gelu, gated, first, std::min(L.n_ff, first + GATED_SPAN));
        }
        team.clock.lap(&LayerTimes::other);
        team.multiply(L.down, gated, h);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            if (L.post_ffw_norm) rms_norm_row(h, nullptr, bf16, t, L.n_embd, L.post_ffw_norm, L.eps, h, nullptr, values);
            for (int64_t i = 0; i < L.n_embd; ++i)
                store_value(x, bf16, t * L.n_embd + i, load_value(x, bf16, t * L.n_embd + i) + load_value(h, bf16, t * L.n_embd + i));
        }
    }
    team.clock.lap(&LayerTimes::other);
}

// A step's per-layer input vectors for one layer: token t's width values at data + t * stride (activation dtype).
struct PerLayerVectors {
    const void* data;
    int64_t stride;
};

// Inside the team, after the MLP: the per-layer input's term, x += post_norm(proj(gelu(gate(x)) * the token's
// vector)), then x *= the output scale, each rounded to the activation dtype as torch's add and multiply round
// (what kvlm.model.per_layer and the block compute op by op). `small`, `gated`: [T][width] buffers, h [T][n_embd].
inline void layer_end_in_team(const LayerSpec& L, LayerTeam& team, void* x, const PerLayerVectors& vectors,
                              void* small, void* gated, void* h, std::vector<float>& values) {
    const bool bf16 = L.bf16, per_layer = L.per_layer_gate.n_parts > 0;
    const int64_t T = team.T, width = L.per_layer_width, element = bf16 ? 2 : 4;
    if (per_layer) {
        team.multiply(L.per_layer_gate, x, small);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t)
            gated_span(static_cast<char*>(small) + t * width * element,
                       static_cast<const char*>(vectors.data) + t * vectors.stride * element, bf16, width, true,
                       static_cast<char*>(gated) + t * width * element);
        team.clock.lap(&LayerTimes::other);
        team.multiply(L.per_layer_proj, gated, h);
    }
    if (!per_layer && !L.output_scale) return;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        if (per_layer) {
            rms_norm_row(h, nullptr, bf16, t, L.n_embd, L.per_layer_norm, L.eps, h, nullptr, values);
            for (int64_t i = 0; i < L.n_embd; ++i)
                store_value(x, bf16, t * L.n_embd + i, load_value(x, bf16, t * L.n_embd + i) + load_value(h, bf16, t * L.n_embd + i));
        }
        if (L.output_scale)
            for (int64_t i = 0; i < L.n_embd; ++i)
                store_value(x, bf16, t * L.n_embd + i, load_value(x, bf16, t * L.n_embd + i) * load_value(L.output_scale, bf16, 0));
    }
    team.clock.lap(&LayerTimes::other);
}

// The layer for S.n_tokens decode tokens, x [n_tokens][n_embd] (the residual stream, updated in place). A layer
// without an MLP (gate_up of no parts: its experts run outside) stops after the attention's residual add and leaves
// the next norm's output in normed_out [n_tokens][n_embd]; a layer with one ends with the per-layer input's term
// (`vectors`) and its output scale.
inline void decode_layer(const LayerSpec& L, const StepSpec& S, int layer, void* x, void* normed_out,
                         const PerLayerVectors& vectors, int n_threads) {
    const bool bf16 = L.bf16;
    const int64_t T = S.n_tokens, element = bf16 ? 2 : 4;
    const int d = L.d, n_heads_all = L.qkv_heads();
    const int64_t q_width = int64_t(L.n_head) * d, qkv_width = L.qkv_width();
    static thread_local LayerBuffers buffers;
    QuantizedRows* act = buffers.quantized;
    void* b[9];
    buffers.carve({T * L.n_embd * element, T * qkv_width * element, T * q_width * element, T * L.n_embd * element,
                   T * 2 * L.n_ff * element, T * L.n_ff * element, T * L.per_layer_width * element,
                   T * L.per_layer_width * element, L.output_gate ? T * q_width * element : 0}, b);
    void *normed = b[0], *qkv = b[1], *attended = b[2], *h = b[3], *gate_up = b[4], *gated = b[5], *queries = b[8];
    const LayerPlanes planes(S, layer, int64_t(L.n_kv) * d);
    // The queries as attention reads them: in the product's rows, or gathered apart from their gates.
    const AttentionWork attention{L.output_gate ? queries : qkv, bf16, L.output_gate ? q_width : qkv_width, T,
                                  L.n_head, L.n_kv, d, L.attention_scale, S.cells, S.offsets, S.lengths,
                                  planes.read(0, L.n_kv, d), planes.read(1, L.n_kv, d), attended, q_width, L.sinks};
    static thread_local std::vector<float> partials;
    std::vector<float>* shared_partials = &partials;
    using T_ = LayerTimes;
#pragma omp parallel num_threads(n_threads)
    {
        static thread_local std::vector<float> values;
        LayerTeam team{bf16, T, act, {}};
        PhaseClock& clock = team.clock;
        clock.start();
        team.first_norm(L, x, normed, values);
        team.multiply(L.qkv, normed, qkv);
        if (L.qk_norm && L.qk_norm_whole) {  // token t's Q (part 0), then its K (part 1), each as one vector
            const int parts = L.k_heads() ? 2 : 1;
#pragma omp for schedule(static)
            for (int64_t task = 0; task < parts * T; ++task) {
                const int part = int(task % parts), heads = part ? L.n_kv : L.n_head;
                const int64_t at = task / parts * qkv_width + (part ? q_width : 0);
                const char* weight = static_cast<const char*>(L.qk_norm) + (part ? q_width * element : 0);
                head_norm_token(qkv, bf16, at, 1, heads * d, weight, L.eps, values);
            }
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < T * n_heads_all; ++task)
            finish_head(L, S, planes, qkv, task / n_heads_all, int(task % n_heads_all), queries, values);
        clock.lap(&T_::other);
        attention_in_team(attention, *shared_partials);
        clock.lap(&T_::attention);
        if (L.output_gate) {  // each head's output times sigmoid(its gate), as sigmoid_gate_row computes it
#pragma omp for schedule(static)
            for (int64_t task = 0; task < T * L.n_head; ++task) {
                const int64_t t = task / L.n_head, head = task % L.n_head;
                gate_head(L, static_cast<char*>(attended) + (t * q_width + head * d) * element,
                          static_cast<const char*>(qkv) + (t * qkv_width + L.head_at(int(head)) + d) * element);
            }
            clock.lap(&T_::other);
        }
        team.multiply(L.output, attended, h);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            if (L.output_bias)  // rounded to the activation dtype, as torch's add
                for (int64_t i = 0; i < L.n_embd; ++i)
                    store_value(h, bf16, t * L.n_embd + i, load_value(h, bf16, t * L.n_embd + i) + load_value(L.output_bias, bf16, i));
            if (L.post_attention_norm)
                rms_norm_row(h, nullptr, bf16, t, L.n_embd, L.post_attention_norm, L.eps, h, nullptr, values);
            rms_norm_row(x, h, bf16, t, L.n_embd, L.ffn_norm, L.eps, normed, x, values);  // x += h, then the norm
        }
        clock.lap(&T_::other);
        mlp_in_team(L, team, x, normed, gate_up, gated, h, normed_out, values);
        layer_end_in_team(L, team, x, vectors, b[6], b[7], h, values);
    }
}

}  // namespace kvlm
