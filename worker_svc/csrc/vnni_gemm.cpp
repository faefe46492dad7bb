// y = x @ W^T + bias over GGUF blocks (Q4_0/Q4_1 projections, a Q8_0 LM head) with int16
// activations (AVX-512 VNNI), for every step size: VPDPWSSD does 32 multiply-adds an
// instruction, against 16 for a float32 FMA, and the codes are multiplied as stored,
// their scales applied once a block.
//
// Activations are quantized per row and block of 32 inputs to int16 with scale amax / 32767
// (int8, as llama.cpp's Q8_0, kept only 62% of the parity prompts' greedy positions on
// SmolLM2-135M). A block's dot product is then exact in int32:
//   sum_k (code_k * d + m) * (q_k * a) = d * a * sum_k code_k * q_k + m * a * sum_k q_k,
// with (d, m) the weight block's scale and offset (Q8_0 has none) and a the activation
// block's scale.
//
// Weights are repacked in panels of 16 output rows, so that one VPDPWSSD lane holds one
// output row and a block's 32 inputs need no horizontal sums. Per panel and block, 4-bit
// weights are eight 32-byte chunks of codes (chunk j's byte 2 * r + i: row r's input
// 2 * j + i in its low nibble, 16 + 2 * j + i in its high one), then the 16 scales and 16
// offsets (float16); 8-bit weights are sixteen chunks (chunk j's bytes 2 * r + i: row r's
// input 2 * j + i), then the 16 scales.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGroup = 32;  // inputs per GGUF block
constexpr int64_t kPanel = 16;  // output rows per panel: one per 32-bit lane of a zmm
// Activation rows per tile, and int32 accumulator chains per row: measured on an AVX-512 EPYC
// (all of SmolLM2's projections, one thread), 2 rows of 4 chains ran at 260-280 GFLOP/s
// at 64-512 rows, against 180-215 for 8 rows of 1 chain and 230-250 for 3 rows of 2.
constexpr int kMaxRows = 2;
constexpr int kChains = 4;

inline __m256i load_chunk(const uint8_t* at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)); }

struct Q4 {
  static constexpr int64_t kCodeBytes = 8 * 32;
  static constexpr int64_t kBlockBytes = kCodeBytes + 2 * kPanel * 2;  // codes, scales, offsets
  static constexpr bool kOffsets = true;
  // Inputs 16 * half + 2 * j, + 1 of the block's 16 rows, as int16 pairs.
  static __m512i weights(const uint8_t* block, int half, int j) {
    const __m512i bytes = _mm512_cvtepu8_epi16(load_chunk(block + 32 * j));
    return half == 0 ? _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F)) : _mm512_srli_epi16(bytes, 4);
  }
};

struct Q8 {
  static constexpr int64_t kCodeBytes = 16 * 32;
  static constexpr int64_t kBlockBytes = kCodeBytes + kPanel * 2;  // codes, scales
  static constexpr bool kOffsets = false;
  static __m512i weights(const uint8_t* block, int half, int j) {
    return _mm512_cvtepi8_epi16(load_chunk(block + 32 * (8 * half + j)));
  }
};

// The activation rows m0 .. m0 + MR against one panel: y[m, n0 .. n0 + 16].
template <class Format, int MR>
void tile(const uint8_t* panel, const int16_t* xq, const float* scales, const float* offset_terms, const float* bias,
          float* y, int64_t K, int64_t N, int64_t n0, int64_t m0) {
  const int64_t blocks = K / kGroup;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, panel += Format::kBlockBytes) {
    __m512i dots[kChains][MR];
    for (int c = 0; c < kChains; ++c)
      for (int m = 0; m < MR; ++m) dots[c][m] = _mm512_setzero_si512();
    for (int half = 0; half < 2; ++half) {  // inputs 0..15, then 16..31: 8 weight registers at a time
      __m512i w[8];
      for (int j = 0; j < 8; ++j) w[j] = Format::weights(panel, half, j);
      for (int j = 0; j < 8; ++j)
        for (int m = 0; m < MR; ++m) {
          int32_t pair;
          std::memcpy(&pair, xq + (m0 + m) * K + b * kGroup + 16 * half + 2 * j, sizeof(pair));
          dots[j % kChains][m] = _mm512_dpwssd_epi32(dots[j % kChains][m], w[j], _mm512_set1_epi32(pair));
        }
    }
    const __m512 d = _mm512_cvtph_ps(load_chunk(panel + Format::kCodeBytes));
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * blocks + b;
      __m512i dot = dots[0][m];
      for (int c = 1; c < kChains; ++c) dot = _mm512_add_epi32(dot, dots[c][m]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(scales[at])), acc[m]);
      if constexpr (Format::kOffsets) {
        const __m512 offset = _mm512_cvtph_ps(load_chunk(panel + Format::kCodeBytes + 2 * kPanel));
        acc[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(offset_terms[at]), acc[m]);
      }
    }
  }
  const __m512 add = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + (m0 + m) * N + n0, _mm512_add_ps(acc[m], add));
}

// Panels are taken in runs of up to kRunPanels, each run's weights staying in L2 while every
// row of x passes over them: a row's outputs are then written a run (4 KB) at a time, not
// 64 bytes at a time down a column of y. For a 49152-row LM head at 256 rows (2 threads),
// panel by panel took 73 ms against 55 for oneDNN's float32 GEMM; in runs, 43 against 50.
constexpr int64_t kRunPanels = 64;

template <class Format>
void linear(const int16_t* xq, const float* scales, const float* offset_terms, const uint8_t* panels,
            const float* bias, float* y, int64_t M, int64_t K, int64_t N, int threads) {
  const int64_t panel_bytes = (K / kGroup) * Format::kBlockBytes;
  const int64_t count = N / kPanel;
  // Short runs where there are few panels, so that every thread gets some.
  const int64_t run = std::max<int64_t>(1, std::min<int64_t>(kRunPanels, count / threads));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t first = 0; first < count; first += run) {
    const int64_t last = std::min(count, first + run);
    int64_t m0 = 0;
    for (; m0 + kMaxRows <= M; m0 += kMaxRows)
      for (int64_t p = first; p < last; ++p)
        tile<Format, kMaxRows>(panels + p * panel_bytes, xq, scales, offset_terms, bias, y, K, N, p * kPanel, m0);
    static_assert(kMaxRows == 2, "the rows left over are one at most");
    if (m0 < M)
      for (int64_t p = first; p < last; ++p)
        tile<Format, 1>(panels + p * panel_bytes, xq, scales, offset_terms, bias, y, K, N, p * kPanel, m0);
  }
}

}  // namespace

// Row m's block b of x [M, K] as int16 into xq, with its scale a (amax / 32767) into scales
// [M, K / 32] and a * (the sum of its int16 values) into offset_terms, which the offsets multiply.
extern "C" void q16_quantize_rows(const float* x, int16_t* xq, float* scales, float* offset_terms, int64_t M,
                                  int64_t K, int threads) {
  const int64_t blocks = K / kGroup;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < M * blocks; ++i) {
    const __m512 lo = _mm512_loadu_ps(x + i * kGroup), hi = _mm512_loadu_ps(x + i * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float scale = amax / 32767.0f;
    const __m512 inverse = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    // Round to nearest even, as the conversion does by default; |values| <= 32767.
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kGroup), _mm512_cvtepi32_epi16(qlo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kGroup + 16), _mm512_cvtepi32_epi16(qhi));
    scales[i] = scale;
    offset_terms[i] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
}

// x quantized by q16_quantize_rows; panels [N / 16, K / 32, block bytes] uint8 as described
// above; bias [N] float32 or null; y [M, N] float32. N a multiple of 16, K of 32. Panels
// are split over `threads` OpenMP threads, each panel's weights staying in L1 for all rows.
extern "C" void q4_vnni_linear(const int16_t* xq, const float* scales, const float* offset_terms,
                               const uint8_t* panels, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                               int threads) {
  linear<Q4>(xq, scales, offset_terms, panels, bias, y, M, K, N, threads);
}

extern "C" void q8_vnni_linear(const int16_t* xq, const float* scales, const float* offset_terms,
                               const uint8_t* panels, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                               int threads) {
  linear<Q8>(xq, scales, offset_terms, panels, bias, y, M, K, N, threads);
}
