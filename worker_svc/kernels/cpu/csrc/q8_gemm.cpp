// y = x @ W^T over 8-bit GGUF blocks (Q8_0) in float32, for steps of few rows: the LM head,
// which shares the token embedding's weights.
//
// W is [N, K] in blocks of 32 weights along K: 32 int8 codes and a float16 scale; weight =
// code * scale, exact in float32 (8 bits times an 11-bit mantissa), so the kernel multiplies
// exactly the dequantized weights. A decode step reads W whole (a quarter of its float32
// bytes): each block is converted once into registers and used for up to 4 rows of x.
#include <immintrin.h>

#include <cstdint>

#include "block_gemm.h"
#include "parallel.h"

namespace {

using block_gemm::kGroup;
constexpr int kTileN = 4;  // output rows a task takes at a time

// The block's 32 weights as 4 vectors of 8 floats, in order.
inline void dequantize_block(const int8_t* codes, const uint16_t* scale, __m256 w[4]) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  const __m256 d = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(*scale)));
  const __m128i low = _mm256_castsi256_si128(packed), high = _mm256_extracti128_si256(packed, 1);
  const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
  for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[j])), d);
}

struct Q8Weights {
  const int8_t* codes;
  const uint16_t* scales;
  void block(int64_t i, __m256 w[4]) const { dequantize_block(codes + i * kGroup, scales + i, w); }
};

// One row of x gets two accumulators per output row, so that enough FMA chains run at once.
template <int MR, int NR>
void tile(const int8_t* codes, const uint16_t* scales, const float* x, float* y, int64_t K, int64_t N, int64_t n0,
          int64_t m0) {
  block_gemm::tile<MR, NR, MR == 1 ? 2 : 1>(Q8Weights{codes, scales}, x, nullptr, y, K, N, n0, m0);
}

// Output rows n0 .. n0 + NR for every row of x: 3 rows of x at a time (NR * 3 accumulators).
template <int NR>
void rows_tile(const int8_t* codes, const uint16_t* scales, const float* x, float* y, int64_t M, int64_t K,
               int64_t N, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 3 <= M; m0 += 3) tile<3, NR>(codes, scales, x, y, K, N, n0, m0);
  switch (M - m0) {
    case 2: tile<2, NR>(codes, scales, x, y, K, N, n0, m0); break;
    case 1: tile<1, NR>(codes, scales, x, y, K, N, n0, m0); break;
    default: break;
  }
}

}  // namespace

// x [M, K] float32; codes [N, K] int8; scales [N, K / 32] float16; y [M, N] float32. All
// contiguous; K a multiple of 32. Output rows are split over `threads` threads.
extern "C" void q8_linear(const float* x, const int8_t* codes, const uint16_t* scales, float* y, int64_t M,
                          int64_t K, int64_t N, int threads) {
  const int64_t tiles = N / kTileN;
  parallel::for_each(threads, tiles, [&](int64_t t) {
    if (M == 1) {  // tiles of 4 output rows for one row of x; of 2 (6 accumulators) for more
      rows_tile<kTileN>(codes, scales, x, y, M, K, N, t * kTileN);
    } else {
      rows_tile<2>(codes, scales, x, y, M, K, N, t * kTileN);
      rows_tile<2>(codes, scales, x, y, M, K, N, t * kTileN + 2);
    }
  });
  for (int64_t n0 = tiles * kTileN; n0 < N; ++n0) rows_tile<1>(codes, scales, x, y, M, K, N, n0);
}
