// The tile of y = x @ W^T + bias that the GGUF GEMMs (q4_gemm.cpp, q8_gemm.cpp) share: W in
// blocks of 32 weights along K, each block unpacked once into registers (by the kernel's
// Weights::block) and used for MR rows of x and NR output rows at a time.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "simd_math.h"

namespace block_gemm {

constexpr int64_t kGroup = 32;  // weights per GGUF block

// Output rows n0 .. n0 + NR of input rows m0 .. m0 + MR, with A accumulators for each pair
// (more FMA chains at once where there are few rows). `weights.block(i, w)` writes block i
// (row-major: row n's blocks are n * K / 32 onwards) as 4 vectors of 8 floats, in order.
template <int MR, int NR, int A, class Weights>
inline void tile(const Weights& weights, const float* x, const float* bias, float* y, int64_t K, int64_t N,
                 int64_t n0, int64_t m0) {
  static_assert(NR * MR * A + 4 <= 16, "accumulators and a block's weights fit AVX2's 16 registers");
  const int64_t blocks = K / kGroup;
  __m256 acc[NR][MR][A];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m)
      for (int a = 0; a < A; ++a) acc[r][m][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int r = 0; r < NR; ++r) {
      __m256 w[4];
      weights.block((n0 + r) * blocks + b, w);
      for (int m = 0; m < MR; ++m) {
        const float* xs = x + (m0 + m) * K + b * kGroup;
        for (int j = 0; j < 4; ++j)
          acc[r][m][j % A] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xs + 8 * j), acc[r][m][j % A]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      __m256 sum = acc[r][m][0];
      for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[r][m][a]);
      y[(m0 + m) * N + n0 + r] = simd::horizontal_sum(sum) + (bias ? bias[n0 + r] : 0.0f);
    }
}

}  // namespace block_gemm
