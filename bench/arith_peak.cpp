// The machine's arithmetic peaks for the instruction mixes the products use (see bench/arith_peak.py):
//   int8: vpmaddubsw (32 u8 x s8 products summed in pairs to s16) then vpmaddwd by ones (pairs to s32) then vpaddd,
//         as kvlm's and llama.cpp's AVX2 kernels multiply 8-bit levels by 8-bit activations: 32 multiply-adds per
//         256-bit step; with AVX-512 VNNI also vpdpbusd (64 per 512-bit instruction);
//   fp32: vfmadd231ps, 8 (AVX2) or 16 (AVX-512) multiply-adds per instruction.
// CHAINS independent accumulators per thread hide each instruction's latency; the operands stay in registers (whatever
// values they hold: timing does not depend on them), so nothing but the arithmetic units is measured.
// Usage: arith_peak THREADS SECONDS; prints one line per mix: "<name> <multiply-adds per second>" (none without AVX2).
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr int CHAINS = 12;
constexpr int64_t STEPS = 1 << 16;  // per timed round, per chain

// One step of every chain, written in assembly so that the compiler can neither hoist the loop-invariant products
// nor spill the accumulators: registers 0..11 accumulate, 12 holds the activations, 13 ones (or a second factor),
// 14 the weights, 15 a temporary (renamed per use, so the chains stay independent).
#define KVLM_12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define KVLM_STR(x) #x
#define KVLM_INT8_AVX2(c) "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\tvpmaddwd %%ymm13, %%ymm15, %%ymm15\n\t" \
                          "vpaddd %%ymm15, %%ymm" KVLM_STR(c) ", %%ymm" KVLM_STR(c) "\n\t"
#define KVLM_FP32_AVX2(c) "vfmadd231ps %%ymm14, %%ymm13, %%ymm" KVLM_STR(c) "\n\t"
#define KVLM_FP32_AVX512(c) "vfmadd231ps %%zmm14, %%zmm13, %%zmm" KVLM_STR(c) "\n\t"
#define KVLM_VNNI512(c) "vpdpbusd %%zmm14, %%zmm12, %%zmm" KVLM_STR(c) "\n\t"

// Runs `body` (one step of the 12 chains) rounds * STEPS times; returns the multiply-adds done (`per_step` a step).
#define KVLM_LOOP(body, per_step, clobbers...)                                                              \
    for (int64_t r = 0; r < rounds * STEPS; ++r) __asm__ volatile(KVLM_12(body) ::: clobbers);            \
    return rounds * STEPS * (per_step);

#define KVLM_YMM "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
                 "xmm12", "xmm13", "xmm14", "xmm15"  // clobbering an xmm register clobbers its ymm and zmm

#if defined(__AVX2__)
int64_t int8_avx2(int64_t rounds) { KVLM_LOOP(KVLM_INT8_AVX2, CHAINS * 32, KVLM_YMM) }
int64_t fp32_avx2(int64_t rounds) { KVLM_LOOP(KVLM_FP32_AVX2, CHAINS * 8, KVLM_YMM) }
#endif

#if defined(__AVX512F__)
int64_t fp32_avx512(int64_t rounds) { KVLM_LOOP(KVLM_FP32_AVX512, CHAINS * 16, KVLM_YMM) }
#endif

#if defined(__AVX512VNNI__)
int64_t int8_vnni512(int64_t rounds) { KVLM_LOOP(KVLM_VNNI512, CHAINS * 64, KVLM_YMM) }
#endif

// Multiply-adds per second of `kernel` on `threads` threads together: each runs rounds until `seconds` have passed.
double rate(int64_t (*kernel)(int64_t), int threads, double seconds) {
    kernel(4);  // clocks up, code in cache
    int64_t total = 0;
    const auto started = std::chrono::steady_clock::now();
    double elapsed = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int64_t done = 0;
        while (std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count() < seconds)
            done += kernel(8);
        total += done;
    }
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return double(total) / elapsed;
}

}  // namespace

int main(int argc, char** argv) {
    const int threads = argc > 1 ? std::atoi(argv[1]) : omp_get_max_threads();
    const double seconds = argc > 2 ? std::atof(argv[2]) : 1.0;
#if defined(__AVX2__)
    std::printf("int8_avx2 %.6g\n", rate(int8_avx2, threads, seconds));
    std::printf("fp32_avx2 %.6g\n", rate(fp32_avx2, threads, seconds));
#endif
#if defined(__AVX512F__)
    std::printf("fp32_avx512 %.6g\n", rate(fp32_avx512, threads, seconds));
#endif
#if defined(__AVX512VNNI__)
    std::printf("int8_vnni512 %.6g\n", rate(int8_vnni512, threads, seconds));
#endif
    return 0;
}
