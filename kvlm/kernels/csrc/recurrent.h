// The recurrent layers between their projections (kvlm/model/recurrent.py), token by token: the depthwise causal
// convolution (LFM2, Mamba2, Qwen3.5), Mamba2's selective scan with its gated RMS norm, and Qwen3.5's gated delta
// net. torch runs prompts through chunked algorithms and single tokens through the recurrence, and its elementwise
// exp, sigmoid or rsqrt round differently in a tensor's vectorized body and its scalar tail; here every token of
// every sequence takes one fixed sequence of float32 operations (SiLU and sigmoid in layer_ops.h's basic operations,
// which round alike in vector and scalar code; the other transcendental functions in scalar std:: calls), so a
// token's result has the same bits whether its
// sequence's earlier tokens came in the same call or an earlier one, whatever other sequences share the call and
// whatever the thread count (work is shared out by sequence and head or channel, never within one's tokens).
// Activations are float32 or bfloat16, rounded once where an output is stored; states are float32. Each sequence's
// state is read from its own address and its new state written to another (or the same: every value is read before
// it is written), so a memory can hand over where it keeps them (kvlm/memory/recurrent.py's two banks per slot)
// instead of gathering them into one tensor and scattering them back.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "delta_rule.h"
#include "layer_ops.h"

namespace kvlm {

// torch's softplus (beta 1, threshold 20): above the threshold x itself, which log1p(exp(x)) rounds to anyway.
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

inline float inverse_rms(const float* x, int64_t n, float eps) {
    return 1.0f / std::sqrt(dot(x, x, n) / float(n) + eps);
}

// Activations of n_seq sequences of the same number of tokens, token t of sequence s in row s * n_tokens + t, rows
// `stride` values apart (a slice of a wider projection's output), float32 or bfloat16.
struct TokenRows {
    const void* data;
    bool bf16;
    int64_t stride;

    float at(int64_t row, int64_t i) const { return load_value(data, bf16, row * stride + i); }

    // Values first .. first + n - 1 of a row, as floats.
    void load(int64_t row, int64_t first, int64_t n, float* out) const {
        load_floats(static_cast<const char*>(data) + (row * stride + first) * (bf16 ? 2 : 4), bf16, n, out);
    }
};

// --- the depthwise causal convolution ---

struct CausalConv {
    TokenRows x;                // [n_seq][n_tokens][channels]
    int64_t n_tokens, channels;
    const void* const* states;  // per sequence [channels][taps - 1]: its last inputs, oldest first
    bool state_bf16;
    const float* weight;        // [channels][taps]
    int taps;
    const float* bias;          // [channels] or null
    bool silu;
    void* out;                  // [n_seq][n_tokens][channels]
    bool out_bf16;
    void* const* new_states;    // per sequence, as states
};

// Channels per unit of the convolution's work: each token's inputs are read as a run of a row (a channel's tokens
// alone would be a row's width apart) into a window of the last `taps` of them, over which the sums vectorize.
constexpr int64_t CONV_CHANNELS = 256;

// Channels first .. first + n - 1 of input p of sequence s, as floats: p counted from the call's first token, the
// state holding p = -(taps - 1) .. -1. State values are read as they are (they were inputs: already in x's dtype).
inline void conv_inputs(const CausalConv& c, int64_t s, int64_t first, int n, int64_t p, float* out) {
    const int history = c.taps - 1;
    if (p >= 0) {
        c.x.load(s * c.n_tokens + p, first, n, out);
        return;
    }
    for (int i = 0; i < n; ++i)
        out[i] = load_value(c.states[s], c.state_bf16, (first + i) * history + history + p);
}

// Channels first .. first + CONV_CHANNELS - 1 (or to the last) of sequence s, token by token: each output is the
// taps from oldest input to newest, then the bias, then the SiLU; the new state the last taps - 1 inputs.
// `scratch`: the window of inputs, the weights tap by tap and the sums.
inline void causal_conv_channels(const CausalConv& c, int64_t s, int64_t first, std::vector<float>& scratch) {
    const int taps = c.taps, history = taps - 1, n = int(std::min(CONV_CHANNELS, c.channels - first));
    scratch.resize(size_t((2 * taps + 1) * CONV_CHANNELS));
    float* window = scratch.data();  // [taps][CONV_CHANNELS]: input p in row (p + history) % taps
    float* weights = window + taps * CONV_CHANNELS;  // [taps][CONV_CHANNELS]
    float* sums = weights + taps * CONV_CHANNELS;
    auto inputs = [&](int64_t p) { return window + (p + history) % taps * CONV_CHANNELS; };
    for (int k = 0; k < taps; ++k)
        for (int i = 0; i < n; ++i) weights[k * CONV_CHANNELS + i] = c.weight[(first + i) * taps + k];
    for (int64_t p = -history; p < 0; ++p) conv_inputs(c, s, first, n, p, inputs(p));
    for (int64_t t = 0; t < c.n_tokens; ++t) {
        conv_inputs(c, s, first, n, t, inputs(t));
        const float* oldest = inputs(t - history);
        for (int i = 0; i < n; ++i) sums[i] = weights[i] * oldest[i];
        for (int k = 1; k < taps; ++k) {
            const float* in = inputs(t - history + k);
            const float* w = weights + k * CONV_CHANNELS;
            for (int i = 0; i < n; ++i) sums[i] += w[i] * in[i];
        }
        if (c.bias)
            for (int i = 0; i < n; ++i) sums[i] += c.bias[first + i];
        if (c.silu)
            for (int i = 0; i < n; ++i) sums[i] = silu_float(sums[i]);
        const int64_t at = (s * c.n_tokens + t) * c.channels + first;
        for (int i = 0; i < n; ++i) store_value(c.out, c.out_bf16, at + i, sums[i]);
    }
    for (int j = 0; j < history; ++j) {  // inputs T - history .. T - 1, still in the window
        const float* in = inputs(c.n_tokens - history + j);
        const int64_t at = first * history + j;
        for (int i = 0; i < n; ++i) store_value(c.new_states[s], c.state_bf16, at + int64_t(i) * history, in[i]);
    }
}

// --- Mamba2's scan and gated RMS norm ---

struct Mamba2Scan {
    const float* xbc;           // [n_seq][n_tokens][H*P + 2*G*N]: the convolution's output, x then B then C
    TokenRows z, dt;            // [n_seq][n_tokens][H*P] and [..][H], in the activation dtype
    int64_t n_tokens;
    int n_heads, head_dim, d_state, n_groups;  // H, P, N, G: head h reads the B and C of group h / (H / G)
    const float *dt_bias, *A_log, *D;          // [H]: A = -exp(A_log)
    const float* norm;          // [H*P]
    float dt_min, dt_max, eps;
    const float* const* states;  // per sequence [H][P][N]
    float* const* new_states;

    int64_t d_inner() const { return int64_t(n_heads) * head_dim; }
    int64_t width() const { return d_inner() + 2 * int64_t(n_groups) * d_state; }
};

// Head h of sequence s over its tokens in order: s = exp(dt A) s + dt x B^T, then y = s C + D x into
// y [n_seq][n_tokens][H*P] (float32, before the norm), with dt = clamp(softplus(dt + dt_bias)).
inline void mamba2_scan_head(const Mamba2Scan& m, int64_t s, int h, float* y) {
    const int P = m.head_dim, N = m.d_state;
    const int64_t head = int64_t(P) * N, d_inner = m.d_inner(), width = m.width();
    const int64_t b_at = d_inner + int64_t(h / (m.n_heads / m.n_groups)) * N;
    const float A = -std::exp(m.A_log[h]);
    const float* before = m.states[s] + h * head;
    float* after = m.new_states[s] + h * head;
    for (int64_t t = 0; t < m.n_tokens; ++t) {
        const int64_t row = s * m.n_tokens + t;
        const float* x = m.xbc + row * width + int64_t(h) * P;
        const float* B = m.xbc + row * width + b_at;
        const float* C = B + int64_t(m.n_groups) * N;
        const float dt = std::fmin(std::fmax(softplus(m.dt.at(row, h) + m.dt_bias[h]), m.dt_min), m.dt_max);
        const float decay = std::exp(dt * A);
        const float* read = t == 0 ? before : after;  // later tokens update the new state in place
        for (int p = 0; p < P; ++p) {
            const float x_dt = x[p] * dt;
            const float* old_row = read + int64_t(p) * N;
            float* row_state = after + int64_t(p) * N;
            for (int n = 0; n < N; ++n) row_state[n] = old_row[n] * decay + x_dt * B[n];
            y[row * d_inner + int64_t(h) * P + p] = dot(row_state, C, N) + m.D[h] * x[p];
        }
    }
}

// Group g of one token (row): y * silu(z), RMS-normalized over the group's H*P/G values, times the norm's weight,
// into out [n_seq][n_tokens][H*P] in the activation dtype.
inline void mamba2_gated_norm(const Mamba2Scan& m, int64_t row, int g, const float* y, void* out,
                              std::vector<float>& values) {
    const int64_t d_inner = m.d_inner(), size = d_inner / m.n_groups, first = g * size;
    values.resize(size);
    m.z.load(row, first, size, values.data());
    for (int64_t i = 0; i < size; ++i) values[i] = y[row * d_inner + first + i] * silu_float(values[i]);
    const float inverse = inverse_rms(values.data(), size, m.eps);
    for (int64_t i = 0; i < size; ++i)
        store_value(out, m.z.bf16, row * d_inner + first + i, values[i] * inverse * m.norm[first + i]);
}

// --- Qwen3.5's gated delta net ---

struct DeltaNet {
    const float* mixed;         // [n_seq][n_tokens][2*Hk*Dk + Hv*Dv]: the convolution's output, q then k then v
    TokenRows z, b, a;          // [n_seq][n_tokens][Hv*Dv], [..][Hv], [..][Hv], in the activation dtype
    int64_t n_tokens;
    int n_k_heads, n_v_heads, dk, dv;  // Hk, Hv, Dk, Dv
    bool v_heads_tiled;         // value head j reads key head j % Hk (llama.cpp's order), else j / (Hv / Hk)
    const float *dt_bias, *A;   // [Hv]: g = A * softplus(a + dt_bias)
    const float* norm;          // [Dv]
    float eps;
    const float* const* states;  // per sequence [Hv][Dk][Dv]
    float* const* new_states;
    void* out;                  // [n_seq][n_tokens][Hv*Dv], in z's dtype

    int64_t key_dim() const { return int64_t(n_k_heads) * dk; }
    int64_t width() const { return 2 * key_dim() + int64_t(n_v_heads) * dv; }
    int key_head(int j) const { return v_heads_tiled ? j % n_k_heads : j / (n_v_heads / n_k_heads); }
};

// Tokens per pass of a head: its inputs are prepared, stepped through and normalized this many at a time, so the
// scratch stays small (the state is carried from pass to pass as from token to token).
constexpr int64_t DELTA_NET_TOKENS = 64;

struct DeltaNetScratch {
    std::vector<float> q, k, g, beta, out, reads;

    void resize(int dk, int dv) {
        q.resize(DELTA_NET_TOKENS * dk);
        k.resize(DELTA_NET_TOKENS * dk);
        g.resize(DELTA_NET_TOKENS);
        beta.resize(DELTA_NET_TOKENS);
        out.resize(DELTA_NET_TOKENS * dv);
        reads.resize(2 * dv);
    }
};

// out = x / sqrt(|x|^2 + 1e-6) * scale: transformers' (and FLA's) l2norm, then q's attention scale.
inline void l2_normalize(const float* x, int n, float scale, float* out) {
    const float inverse = 1.0f / std::sqrt(dot(x, x, n) + 1e-6f);
    for (int i = 0; i < n; ++i) out[i] = x[i] * inverse * scale;
}

// Value head j's inputs for the token in `row`, into slot i of the scratch: q and k of its key head normalized
// (q scaled by Dk^-0.5), beta = sigmoid(b), g = A softplus(a + dt_bias).
inline void delta_net_inputs(const DeltaNet& d, int64_t row, int j, DeltaNetScratch& scratch, int64_t i) {
    const float* q = d.mixed + row * d.width() + int64_t(d.key_head(j)) * d.dk;
    const float scale = float(1.0 / std::sqrt(double(d.dk)));
    l2_normalize(q, d.dk, scale, scratch.q.data() + i * d.dk);
    l2_normalize(q + d.key_dim(), d.dk, 1.0f, scratch.k.data() + i * d.dk);
    scratch.beta[i] = sigmoid_float(d.b.at(row, j));
    scratch.g[i] = d.A[j] * softplus(d.a.at(row, j) + d.dt_bias[j]);
}

// Value head j's output o for the token in `row`: RMSNorm(o) * weight * silu(z) (the gate after the norm).
inline void delta_net_output(const DeltaNet& d, int64_t row, int j, const float* o) {
    const float inverse = inverse_rms(o, d.dv, d.eps);
    const int64_t value_dim = int64_t(d.n_v_heads) * d.dv, first = int64_t(j) * d.dv;
    static thread_local std::vector<float> gated;
    gated.resize(size_t(d.dv));
    d.z.load(row, first, d.dv, gated.data());
    for (int i = 0; i < d.dv; ++i) gated[i] = o[i] * inverse * d.norm[i] * silu_float(gated[i]);
    store_floats(static_cast<char*>(d.out) + (row * value_dim + first) * (d.z.bf16 ? 2 : 4), d.z.bf16, d.dv,
                 gated.data());
}

// Value head j of sequence s over its tokens in order: the delta rule stepped token by token (delta_rule.h) between
// its inputs and its gated norm.
inline void delta_net_head(const DeltaNet& d, int64_t s, int j, DeltaNetScratch& scratch) {
    scratch.resize(d.dk, d.dv);
    const int64_t head = int64_t(d.dk) * d.dv, width = d.width();
    const float* state = d.states[s] + j * head;
    float* new_state = d.new_states[s] + j * head;
    for (int64_t first = 0; first < d.n_tokens; first += DELTA_NET_TOKENS) {
        const int64_t count = std::min(DELTA_NET_TOKENS, d.n_tokens - first), row = s * d.n_tokens + first;
        for (int64_t i = 0; i < count; ++i) delta_net_inputs(d, row + i, j, scratch, i);
        const float* v = d.mixed + row * width + 2 * d.key_dim() + int64_t(j) * d.dv;
        const DeltaTokens tokens{scratch.q.data(), scratch.k.data(), v, scratch.g.data(), scratch.beta.data(),
                                 scratch.out.data(), d.dk, width, 1, d.dv};
        delta_rule_head(first == 0 ? state : new_state, new_state, tokens, count, d.dk, d.dv, scratch.reads.data());
        for (int64_t i = 0; i < count; ++i) delta_net_output(d, row + i, j, scratch.out.data() + i * d.dv);
    }
}

}  // namespace kvlm
