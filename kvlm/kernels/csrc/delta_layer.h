// A whole Gated DeltaNet layer (Qwen3.5) for decode tokens in one call, as decode_layer.h runs an attention layer:
// the norm, the stacked input projection (q, k, v, the output gate z, beta's b and the decay's a), the causal
// convolution with its SiLU and the gated delta rule (recurrent.h: each sequence's states read and written where the
// memory keeps them), the output projection, the residual add and the next norm, then the MLP (or, for a layer of
// experts, their input). Python runs the same as a dozen calls; each phase here calls the functions those calls
// call, in the same dtypes at the same points, so the layer's result is theirs, bit for bit.
#pragma once

#include <omp.h>

#include <cstdint>
#include <vector>

#include "decode_layer.h"
#include "recurrent.h"

namespace kvlm {

// The mixer's weights (LayerSpec holds the norms and the MLP).
struct DeltaMixer {
    Matrix in_proj;            // [2*Hk*Dk + Hv*Dv + Hv*Dv + 2*Hv][n_embd]: q, k, v, z, b, a
    Matrix out_proj;           // [n_embd][Hv*Dv]
    const float* conv;         // [2*Hk*Dk + Hv*Dv][taps]: the depthwise filter over q, k, v (no bias)
    int taps;
    int n_k_heads, n_v_heads, dk, dv;
    int v_heads_tiled;         // value head j reads key head j % Hk, else j / (Hv / Hk)
    const float *dt_bias, *A;  // [Hv]
    const float* norm;         // [Dv]: the gated RMS norm's weight
    float eps;                 // the gated norm's

    int64_t key_dim() const { return int64_t(n_k_heads) * dk; }
    int64_t value_dim() const { return int64_t(n_v_heads) * dv; }
    int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
    int64_t projected() const { return conv_dim() + value_dim() + 2 * int64_t(n_v_heads); }
};

// Where each sequence's convolution state and delta-rule state are read and their new values written (may be the
// same addresses: every value is read before it is written).
struct DeltaStates {
    const void* const* conv_sources;
    void* const* conv_targets;
    const float* const* sources;
    float* const* targets;
};

// n_seq sequences of n_tokens tokens each, x [n_seq * n_tokens][n_embd] (the residual stream, sequence by sequence,
// updated in place). A layer without an MLP (gate_up of no parts) leaves its experts' input in normed_out.
inline void delta_layer(const LayerSpec& L, const DeltaMixer& M, int64_t n_seq, int64_t n_tokens,
                        const DeltaStates& states, void* x, void* normed_out, int n_threads) {
    const bool bf16 = L.bf16;
    const int64_t T = n_seq * n_tokens, element = bf16 ? 2 : 4, width = M.projected();
    const int64_t conv_dim = M.conv_dim(), value_dim = M.value_dim();
    static thread_local LayerBuffers buffers;
    QuantizedRows* act = buffers.quantized;
    void* b[7];
    buffers.carve({T * L.n_embd * element, T * width * element, T * conv_dim * 4, T * value_dim * element,
                   T * L.n_embd * element, T * 2 * L.n_ff * element, T * L.n_ff * element}, b);
    void *normed = b[0], *projected = b[1], *y = b[3], *h = b[4], *gate_up = b[5], *gated = b[6];
    float* mixed = static_cast<float*>(b[2]);  // the convolution's output after the SiLU: float32, as torch's
    const auto column = [&](int64_t first) { return static_cast<const char*>(projected) + first * element; };
    const CausalConv conv{{projected, bf16, width}, n_tokens, conv_dim, states.conv_sources, false, M.conv, M.taps,
                          nullptr, true, mixed, false, states.conv_targets};
    const DeltaNet net{mixed, {column(conv_dim), bf16, width}, {column(conv_dim + value_dim), bf16, width},
                       {column(conv_dim + value_dim + M.n_v_heads), bf16, width}, n_tokens, M.n_k_heads,
                       M.n_v_heads, M.dk, M.dv, M.v_heads_tiled != 0, M.dt_bias, M.A, M.norm, M.eps, states.sources,
                       states.targets, y};
    const int64_t conv_blocks = (conv_dim + CONV_CHANNELS - 1) / CONV_CHANNELS;
    using T_ = LayerTimes;
#pragma omp parallel num_threads(n_threads)
    {
        static thread_local std::vector<float> values;
        static thread_local DeltaNetScratch scratch;
        LayerTeam team{bf16, T, act, {}};
        PhaseClock& clock = team.clock;
        clock.start();
        team.first_norm(L, x, normed, values);
        team.multiply(M.in_proj, normed, projected);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_seq * conv_blocks; ++i)
            causal_conv_channels(conv, i / conv_blocks, i % conv_blocks * CONV_CHANNELS, values);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_seq * M.n_v_heads; ++i) delta_net_head(net, i / M.n_v_heads, int(i % M.n_v_heads), scratch);
        clock.lap(&T_::other);
        team.multiply(M.out_proj, y, h);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) rms_norm_row(x, h, bf16, t, L.n_embd, L.ffn_norm, L.eps, normed, x, values);
        clock.lap(&T_::other);
        mlp_in_team(L, team, x, normed, gate_up, gated, h, normed_out, values);
    }
}

}  // namespace kvlm
