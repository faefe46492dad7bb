// y = x @ W^T + bias over 4-bit GGUF blocks (Q4_0, Q4_1) in float32, for steps of few rows.
//
// W is [N, K] in blocks of 32 weights along K. Each block is 16 bytes of codes (byte j holds
// weight j in its low nibble and weight j + 16 in its high one, as GGUF stores them) and a
// float16 (scale, offset) pair: weight = code * scale + offset. code * scale is exact in
// float32 (4 bits times an 11-bit mantissa), so fma(code, scale, offset) rounds once, as
// the float32 dequantizer does: the kernel multiplies exactly the dequantized weights.
//
// Decode steps are memory-bound (~0.6 bytes a weight): each block is unpacked once into
// registers and used for up to 8 rows of x, so that unpacking costs less per row as rows
// grow. Fewer than 4 rows take 2 output rows at a time, for enough independent FMA chains.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "block_gemm.h"
#include "parallel.h"

namespace {

using block_gemm::kGroup;
constexpr int kTileN = 2;  // output rows per tile

// The block's 32 weights as 4 vectors of 8 floats, in order.
inline void dequantize_block(const uint8_t* codes, const uint16_t* scale_offset, __m256 w[4]) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask);                     // weights 0..15
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // weights 16..31
  uint32_t pair;
  std::memcpy(&pair, scale_offset, sizeof(pair));
  const __m128 so = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(pair)));  // [scale, offset, 0, 0]
  const __m256 scale = _mm256_broadcastss_ps(so);
  const __m256 offset = _mm256_broadcastss_ps(_mm_movehdup_ps(so));
  const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
  for (int j = 0; j < 4; ++j) {
    const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
    w[j] = _mm256_fmadd_ps(code, scale, offset);
  }
}

struct Q4Weights {
  const uint8_t* codes;
  const uint16_t* scale_offsets;
  void block(int64_t i, __m256 w[4]) const { dequantize_block(codes + i * (kGroup / 2), scale_offsets + i * 2, w); }
};

// Fewer rows get more accumulators each, so that enough FMA chains run at once.
template <int MR, int NR>
void tile(const uint8_t* codes, const uint16_t* scale_offsets, const float* x, const float* bias, float* y,
          int64_t K, int64_t N, int64_t n0, int64_t m0) {
  constexpr int A = MR == 1 ? 4 : (MR == 2 ? 2 : 1);
  block_gemm::tile<MR, NR, A>(Q4Weights{codes, scale_offsets}, x, bias, y, K, N, n0, m0);
}

template <int NR>
void rows_tile(const uint8_t* codes, const uint16_t* so, const float* x, const float* bias, float* y,
               int64_t M, int64_t K, int64_t N, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 8 <= M; m0 += 8)  // 8 accumulators: one output row at a time
    for (int r = 0; r < NR; ++r) tile<8, 1>(codes, so, x, bias, y, K, N, n0 + r, m0);
  if (M - m0 >= 4) {
    tile<4, NR>(codes, so, x, bias, y, K, N, n0, m0);
    m0 += 4;
  }
  switch (M - m0) {
    case 3: tile<3, NR>(codes, so, x, bias, y, K, N, n0, m0); break;
    case 2: tile<2, NR>(codes, so, x, bias, y, K, N, n0, m0); break;
    case 1: tile<1, NR>(codes, so, x, bias, y, K, N, n0, m0); break;
    default: break;
  }
}

}  // namespace

// x [M, K] float32; codes [N, K / 32, 16] uint8; scale_offsets [N, K / 32, 2] float16;
// bias [N] float32 or null; y [M, N] float32. All contiguous; K a multiple of 32. Output
// rows are split over `threads` threads.
extern "C" void q4_linear(const float* x, const uint8_t* codes, const uint16_t* scale_offsets, const float* bias,
                          float* y, int64_t M, int64_t K, int64_t N, int threads) {
  const int64_t tiles = N / kTileN;
  parallel::for_each(threads, tiles,
                     [&](int64_t t) { rows_tile<kTileN>(codes, scale_offsets, x, bias, y, M, K, N, t * kTileN); });
  for (int64_t n0 = tiles * kTileN; n0 < N; ++n0) rows_tile<1>(codes, scale_offsets, x, bias, y, M, K, N, n0);
}

// The float32 weights [N, K] into w: for steps too big for q4_linear, which then run a
// float32 GEMM over them. One pass of vector stores, rows split over `threads`.
extern "C" void q4_dequantize(const uint8_t* codes, const uint16_t* scale_offsets, float* w, int64_t N, int64_t K,
                              int threads) {
  const int64_t blocks = N * (K / kGroup);
  parallel::for_each(threads, blocks, [&](int64_t b) {
    __m256 v[4];
    dequantize_block(codes + b * (kGroup / 2), scale_offsets + b * 2, v);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(w + b * kGroup + 8 * j, v[j]);
  });
}
