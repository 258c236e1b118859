// Qwen3.5's gated delta rule for one token (kvlm/model/recurrent.py's delta_step), one head at a time: the head's
// state S [dk][dv] (float32, 64 KB at 128 x 128) is read once for S^T k and S^T q, then once more, still in cache, as
// S' = decay S + k delta^T is written. Torch's version reads it three times and writes a fresh decayed copy.
// Several tokens run as that step repeated, token by token: the same floats whether they come in one call or many.
#pragma once

#include <cmath>
#include <cstdint>

#include "layer_ops.h"

namespace kvlm {

// With decay = exp(g): k_read = S^T k, q_read = S^T q; delta = beta (v - decay k_read);
// out = decay q_read + (k . q) delta; S' = decay S + k delta^T. `reads` is scratch of 2 * dv floats.
// new_state may be state itself (each row is read before it is written).
inline void delta_step_head(const float* state, float* new_state, const float* q, const float* k, const float* v,
                            float g, float beta, float* out, int dk, int dv, float* reads) {
    float* __restrict k_read = reads;
    float* __restrict q_read = reads + dv;
    for (int j = 0; j < dv; ++j) k_read[j] = q_read[j] = 0.0f;
    for (int i = 0; i < dk; ++i) {  // rows of S, accumulated along them: vectorized over j
        const float* __restrict row = state + int64_t(i) * dv;
        const float ki = k[i], qi = q[i];
        for (int j = 0; j < dv; ++j) {
            k_read[j] += ki * row[j];
            q_read[j] += qi * row[j];
        }
    }
    const float decay = std::exp(g), kq = dot(k, q, dk);
    float* __restrict delta = k_read;  // k_read is not needed past its own delta
    for (int j = 0; j < dv; ++j) {
        const float d = beta * (v[j] - decay * k_read[j]);
        out[j] = decay * q_read[j] + kq * d;
        delta[j] = d;
    }
    for (int i = 0; i < dk; ++i) {
        const float* row = state + int64_t(i) * dv;
        float* written = new_state + int64_t(i) * dv;
        const float ki = k[i];
        for (int j = 0; j < dv; ++j) written[j] = decay * row[j] + ki * delta[j];
    }
}

// One head's inputs over a run of tokens, each at t times its stride: q and k (dk values), v (dv), g and beta (one
// each); token t's output (dv values) goes to out + t * out_stride.
struct DeltaTokens {
    const float *q, *k, *v, *g, *beta;
    float* out;
    int64_t qk_stride, v_stride, gate_stride, out_stride;
};

// The gated delta rule over n_tokens tokens of one head, in order, one delta_step_head each: the first reads
// `state`, each later one the state its predecessor wrote to new_state, which ends as the state after the last
// (`state` is left as it was). A single token is therefore exactly one delta_step_head, as kvlm_delta_step's.
inline void delta_rule_head(const float* state, float* new_state, const DeltaTokens& in, int64_t n_tokens, int dk,
                            int dv, float* reads) {
    for (int64_t t = 0; t < n_tokens; ++t)
        delta_step_head(t == 0 ? state : new_state, new_state, in.q + t * in.qk_stride, in.k + t * in.qk_stride,
                        in.v + t * in.v_stride, in.g[t * in.gate_stride], in.beta[t * in.gate_stride],
                        in.out + t * in.out_stride, dk, dv, reads);
}

}  // namespace kvlm
