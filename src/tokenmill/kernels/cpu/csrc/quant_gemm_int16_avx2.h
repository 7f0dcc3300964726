// The batched 16-bit-activation product on AVX2 builds (cpu_quant_gemm_int16_avx2.cpp); the op
// quant_gemm_vnni16 (cpu_quant_gemm_vnni.cpp) calls it where the build has AVX2 but not AVX-512 VNNI.
#pragma once

#include <cstdint>

namespace tokenmill_cpu {

// Whether this build has the AVX2 kernel.
bool gemm_int16_avx2_available();

// y [m, n] float32 = x [m, 32 num_blocks] float32 (16-bit-quantized per block of 32) @ dequant(w)^T,
// w [n, row bytes] in the few-row kernel's vnni layout; q4: Q4_1, else Q8_0.
void gemm_int16_avx2(const float* x, const uint8_t* w, float* y, int64_t m, int64_t n, int64_t num_blocks, bool q4);

}  // namespace tokenmill_cpu
