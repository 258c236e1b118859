// A mixture-of-experts feed-forward block in one call: each token's chosen experts, tokens grouped by expert, each
// expert's matrices read once per call from the quantized blocks its file stores them in (no dequantized copies).
//
//   out[t] = sum over j < n_used of weight[t][j] * down_e(act(gate_e x_t, up_e x_t)),  e = ids[t][j]
//
// with act(g, u) = silu(g) u or gelu(g) u, or gpt-oss's clamped SwiGLU; gpt-oss's experts also add a bias to each
// of their products.
//
// The routing (which experts, with what weights) is the caller's. Pairs (token, expert) are sorted by expert; all
// pairs' rows are gathered and quantized once, then the team shares the units of 8 output rows of every chosen
// expert (costed by how many tokens each unit multiplies), so batch-1 decode reads only the chosen experts' weights
// and needs two barriers, not two per expert. A row's result does not depend on the other rows (the products
// never mix rows), and each token's sum runs over its slots in order: the output is batch-invariant.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "layer_ops.h"
#include "products.h"

namespace kvlm {

// A 3-D tensor of experts' matrices: expert e's `rows` rows (of the spec's width) start at base + e * stride bytes.
struct ExpertMatrix {
    int32_t type;
    const uint8_t* base;
    int64_t stride;
    int64_t rows;
    int32_t interleaved;
};

enum ExpertActivation : int32_t { EXPERTS_SILU = 0, EXPERTS_GELU = 1, EXPERTS_SWIGLU_OAI = 2 };

struct ExpertsSpec {
    int64_t n_embd, n_ff;  // gate and up: n_ff rows of n_embd; down: n_embd rows of n_ff
    int32_t n_expert;
    int32_t activation;  // an ExpertActivation
    ExpertMatrix gate, up, down;
    float alpha, limit;  // EXPERTS_SWIGLU_OAI's sigmoid gain and clamp
    const float* gate_up_bias;  // [n_expert][2 n_ff]: each expert's gate bias then its up bias; or null
    const float* down_bias;     // [n_expert][n_embd], or null
};

// gpt-oss's activation: the gate clamped above at `limit`, up to [-limit, limit], then (up + 1) gate sigmoid(alpha gate).
inline float swiglu_oai(float gate, float up, float alpha, float limit) {
    const float g = std::min(gate, limit), u = std::clamp(up, -limit, limit);
    return (u + 1.0f) * (g / (1.0f + std::exp(-alpha * g)));
}

// Pair p's activation a [n_ff] from its [gate | up] h [2 n_ff], with expert e's biases (if any) added first.
inline void expert_activation(const ExpertsSpec& s, float* h, int64_t p, int32_t e, float* a) {
    float* row = h + p * 2 * s.n_ff;
    if (s.gate_up_bias)
        for (int64_t i = 0; i < 2 * s.n_ff; ++i) row[i] += s.gate_up_bias[e * 2 * s.n_ff + i];
    if (s.activation != EXPERTS_SWIGLU_OAI) {
        gated_row(h, false, p, s.n_ff, s.activation == EXPERTS_GELU, a);
        return;
    }
    for (int64_t i = 0; i < s.n_ff; ++i) a[p * s.n_ff + i] = swiglu_oai(row[i], row[s.n_ff + i], s.alpha, s.limit);
}

// One expert's gate and up (stacked, so one pass yields [gate | up] per row) and its down projection, as the
// products read them; the arrays live here so that Matrix can point at them.
struct ExpertProducts {
    int32_t types[2];
    const uint8_t* weights[2];
    int64_t rows[2];
    int32_t interleaved[2];
    int32_t down_type;
    const uint8_t* down_weights;
    int64_t down_rows;
    int32_t down_interleaved;

    ExpertProducts(const ExpertsSpec& s, int e)
        : types{s.gate.type, s.up.type},
          weights{s.gate.base + e * s.gate.stride, s.up.base + e * s.up.stride},
          rows{s.gate.rows, s.up.rows},
          interleaved{s.gate.interleaved, s.up.interleaved},
          down_type(s.down.type),
          down_weights(s.down.base + e * s.down.stride),
          down_rows(s.down.rows),
          down_interleaved(s.down.interleaved) {}

    Matrix gate_up(int64_t k) const { return Matrix{2, types, weights, rows, interleaved, k}; }
    Matrix down(int64_t k) const { return Matrix{1, &down_type, &down_weights, &down_rows, &down_interleaved, k}; }
};

inline int check_experts(const ExpertsSpec& s) {
    if (s.n_expert <= 0 || s.gate.rows != s.n_ff || s.up.rows != s.n_ff || s.down.rows != s.n_embd) return BAD_SHAPE;
    const ExpertProducts first(s, 0);
    const int status = check_matrix(first.gate_up(s.n_embd));
    return status != OK ? status : check_matrix(first.down(s.n_ff));
}

// The experts that have tokens, in id order, each with its run of the pairs sorted by expert.
struct Routing {
    std::vector<int32_t> experts;
    std::vector<RowSpan> spans;    // of each such expert, in the sorted pairs
    std::vector<int64_t> position;  // of pair t * n_used + j, in the sorted pairs
    std::vector<int64_t> token;     // of each sorted pair
    std::vector<int32_t> expert;    // of each sorted pair

    bool build(const int32_t* ids, int64_t n_pairs, int n_used, int32_t n_expert) {
        std::vector<int64_t> start(size_t(n_expert) + 1, 0);
        for (int64_t p = 0; p < n_pairs; ++p) {
            if (ids[p] < 0 || ids[p] >= n_expert) return false;
            ++start[size_t(ids[p]) + 1];
        }
        experts.clear();
        spans.clear();
        for (int32_t e = 0; e < n_expert; ++e) {
            if (start[size_t(e) + 1] > 0) {
                experts.push_back(e);
                spans.push_back(RowSpan{start[size_t(e)], start[size_t(e)] + start[size_t(e) + 1]});
            }
            start[size_t(e) + 1] += start[size_t(e)];
        }
        position.resize(size_t(n_pairs));
        token.resize(size_t(n_pairs));
        expert.resize(size_t(n_pairs));
        for (int64_t p = 0; p < n_pairs; ++p) {  // in pair order: each expert's tokens stay in token order
            const int64_t at = start[size_t(ids[p])]++;
            position[size_t(p)] = at;
            token[size_t(at)] = p / n_used;
            expert[size_t(at)] = ids[p];
        }
        return true;
    }
};

// Thread `thread` of `count`'s units of each active expert's matrix: units cost the rows they multiply plus a
// fixed part for reading the weights, and the threads take equal runs of the total cost.
inline void share_units(const Routing& routing, int64_t units, int thread, int count,
                        std::vector<std::pair<int64_t, int64_t>>& mine) {
    constexpr int64_t READ_COST = 4;  // a unit's weights cost about as much to read as this many rows to multiply
    int64_t total = 0;
    for (size_t i = 0; i < routing.experts.size(); ++i)
        total += units * (routing.spans[i].end - routing.spans[i].begin + READ_COST);
    const int64_t from = total * thread / count, to = total * (thread + 1) / count;
    mine.clear();
    int64_t start = 0;
    for (size_t i = 0; i < routing.experts.size(); ++i) {
        const int64_t cost = routing.spans[i].end - routing.spans[i].begin + READ_COST;
        const auto unit_at = [&](int64_t c) { return std::clamp((c - start + cost - 1) / cost, int64_t(0), units); };
        mine.emplace_back(unit_at(from), unit_at(to));
        start += units * cost;
    }
}

// out [n_tokens][n_embd] (x's dtype) for x [n_tokens][n_embd], ids and weights [n_tokens][n_used].
inline void experts_ffn(const ExpertsSpec& s, const void* x, bool bf16, int64_t n_tokens, int n_used,
                        const Routing& routing, const float* weights, void* out, int n_threads) {
    const int64_t n_pairs = n_tokens * n_used;
    // Buffers shared by the team: the calling thread's, reused from call to call.
    static thread_local std::vector<float> gathered, hidden, activated, expert_out;
    static thread_local QuantizedRows quantized[4];
    static thread_local std::vector<ExpertProducts> products;
    gathered.resize(size_t(n_pairs * s.n_embd));
    hidden.resize(size_t(n_pairs * 2 * s.n_ff));
    activated.resize(size_t(n_pairs * s.n_ff));
    expert_out.resize(size_t(n_pairs * s.n_embd));
    products.clear();
    for (int32_t e : routing.experts) products.emplace_back(s, e);
    float *xs = gathered.data(), *h = hidden.data(), *a = activated.data(), *ys = expert_out.data();
    QuantizedRows *act_in = quantized, *act_mid = quantized + 2;
    const std::vector<ExpertProducts>& experts = products;
    bool wanted_in[2] = {false, false}, wanted_mid[2] = {false, false};
    wanted_formats(experts[0].gate_up(s.n_embd), wanted_in);
    wanted_formats(experts[0].down(s.n_ff), wanted_mid);
    const int64_t gate_up_units = matrix_units(experts[0].gate_up(s.n_embd));
    const int64_t down_units = matrix_units(experts[0].down(s.n_ff));
#pragma omp parallel num_threads(n_threads)
    {
        static thread_local std::vector<std::pair<int64_t, int64_t>> mine;
        const int thread = omp_get_thread_num(), count = omp_get_num_threads();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < n_pairs; ++p)
            for (int64_t i = 0; i < s.n_embd; ++i) xs[p * s.n_embd + i] = load_value(x, bf16, routing.token[p] * s.n_embd + i);
        // This thread's share of every chosen expert's matrix (gate_up, else down) times its rows; then all wait.
        const auto multiply = [&](bool gate_up, const QuantizedRows* act, float* out) {
            share_units(routing, gate_up ? gate_up_units : down_units, thread, count, mine);
            for (size_t i = 0; i < experts.size(); ++i)
                multiply_units(gate_up ? experts[i].gate_up(s.n_embd) : experts[i].down(s.n_ff), act,
                               routing.spans[i], mine[i].first, mine[i].second, out, false);
#pragma omp barrier
        };
        quantize_in_team(xs, false, n_pairs, s.n_embd, wanted_in, act_in);
        multiply(true, act_in, h);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < n_pairs; ++p) expert_activation(s, h, p, routing.expert[size_t(p)], a);
        quantize_in_team(a, false, n_pairs, s.n_ff, wanted_mid, act_mid);
        multiply(false, act_mid, ys);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n_tokens; ++t)
            for (int64_t i = 0; i < s.n_embd; ++i) {
                float sum = 0.0f;
                for (int j = 0; j < n_used; ++j) {
                    const int64_t p = routing.position[size_t(t * n_used + j)];
                    const float bias = s.down_bias ? s.down_bias[routing.expert[size_t(p)] * s.n_embd + i] : 0.0f;
                    sum += weights[t * n_used + j] * (ys[p * s.n_embd + i] + bias);
                }
                store_value(out, bf16, t * s.n_embd + i, sum);
            }
    }
}

}  // namespace kvlm
