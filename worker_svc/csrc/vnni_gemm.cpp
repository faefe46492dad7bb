// y = x @ W^T + bias over GGUF blocks (Q4_0/Q4_1 projections, a Q8_0 LM head) with int16
// activations (AVX-512 VNNI), for every step size: the codes are multiplied as stored, their
// scales applied once a block.
//
// Activations are quantized per row and block of 32 inputs to int16 with scale amax / 32767
// (int8, as llama.cpp's Q8_0, kept only 62% of the parity prompts' greedy positions on
// SmolLM2-135M). A block's dot product is then exact in int32:
//   sum_k (code_k * d + m) * (q_k * a) = d * a * sum_k code_k * q_k + m * a * sum_k q_k,
// with (d, m) the weight block's scale and offset (Q8_0 has none) and a the activation
// block's scale.
//
// Weights are repacked in panels of 16 output rows, so that one 32-bit lane holds one output
// row and a block's 32 inputs need no horizontal sums.
//
// 4-bit weights run on VPDPBUSD (unsigned by signed bytes, 64 products an instruction): each
// int16 activation q = 256 * hi + lo is stored as its bytes, lo unsigned and hi signed (per
// row and block: the 32 lo bytes, then the 32 hi bytes), and the codes 0..15 are either
// operand, so sum code * q = 256 * sum code * hi + sum code * lo takes two instructions per
// 64 products, as VPDPWSSD on int16 pairs would, but the codes need only a mask or a shift,
// not a widening to int16. Per panel and block: four 64-byte chunks of codes (chunk g's byte
// 4 * r + i: row r's input 4 * g + i in its low nibble, 16 + 4 * g + i in its high one), then
// the 16 scales and 16 offsets (float16). On a 2-core Xeon (AVX-512, two VNNI instructions a
// cycle), SmolLM2's projections ran 1.4-1.7x faster at 64-2048 rows than on VPDPWSSD.
//
// 8-bit weights (signed codes) stay on VPDPWSSD against int16 pairs: sixteen 32-byte chunks
// (chunk j's bytes 2 * r + i: row r's input 2 * j + i), then the 16 scales.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGroup = 32;  // inputs per GGUF block
constexpr int64_t kPanel = 16;  // output rows per panel: one per 32-bit lane of a zmm

inline __m256i load_chunk(const uint8_t* at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)); }

inline __m512i broadcast_4_bytes(const uint8_t* at) {
  int32_t four;
  std::memcpy(&four, at, sizeof(four));
  return _mm512_set1_epi32(four);
}

// y[m, n0 .. n0 + 16 * NR] for rows m0 .. m0 + MR from the integer dots of one block: the
// scales' products in float32, in one order whatever the tile.
template <int MR, int NR, bool Offsets>
inline void add_block(__m512 (&acc)[MR][NR], const __m512i (&dots)[MR][NR], const uint8_t* const (&scales_of)[NR],
                      const float* scales, const float* offset_terms, int64_t blocks, int64_t b, int64_t m0) {
  for (int n = 0; n < NR; ++n) {
    const __m512 d = _mm512_cvtph_ps(load_chunk(scales_of[n]));
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * blocks + b;
      acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[m][n]), _mm512_mul_ps(d, _mm512_set1_ps(scales[at])),
                                  acc[m][n]);
      if constexpr (Offsets) {
        const __m512 offset = _mm512_cvtph_ps(load_chunk(scales_of[n] + 2 * kPanel));
        acc[m][n] = _mm512_fmadd_ps(offset, _mm512_set1_ps(offset_terms[at]), acc[m][n]);
      }
    }
  }
}

template <int MR, int NR>
inline void store(const __m512 (&acc)[MR][NR], const float* bias, float* y, int64_t N, int64_t n0, int64_t m0) {
  for (int n = 0; n < NR; ++n) {
    const __m512 add = bias ? _mm512_loadu_ps(bias + n0 + kPanel * n) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + (m0 + m) * N + n0 + kPanel * n, _mm512_add_ps(acc[m][n], add));
  }
}

struct Q4 {
  static constexpr int64_t kCodeBytes = 4 * 64;
  static constexpr int64_t kBlockBytes = kCodeBytes + 2 * kPanel * 2;  // codes, scales, offsets
  // Activation rows and panels per tile: 4 x 2 ran at 230-255 GFLOP/s (2 threads, 64-2048
  // rows), 3 x 3 and 2 x 3 alike, 4 x 1 at 145-185, 2 x 1 at 120-155.
  static constexpr int kRows = 4, kPanels = 2;

  // Rows m0 .. m0 + MR of x (split bytes) against panels n0 / 16 .. + NR, panel_bytes apart.
  template <int MR, int NR>
  static void tile(const uint8_t* panel, int64_t panel_bytes, const uint8_t* x, const float* scales,
                   const float* offset_terms, const float* bias, float* y, int64_t K, int64_t N, int64_t n0,
                   int64_t m0) {
    const int64_t blocks = K / kGroup;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc[MR][NR];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, panel += kBlockBytes) {
      __m512i lo[MR][NR], hi[MR][NR];  // sum code * lo and sum code * hi: two chains per tile
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) lo[m][n] = hi[m][n] = _mm512_setzero_si512();
      for (int g = 0; g < 4; ++g) {
        __m512i low[NR], high[NR];  // the codes of inputs 4g .. 4g + 3 and 16 + 4g .. 16 + 4g + 3
        for (int n = 0; n < NR; ++n) {
          const __m512i codes = _mm512_loadu_si512(panel + n * panel_bytes + 64 * g);
          low[n] = _mm512_and_si512(codes, nibble);
          high[n] = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble);
        }
        for (int m = 0; m < MR; ++m) {
          const uint8_t* row = x + ((m0 + m) * blocks + b) * 2 * kGroup + 4 * g;
          const __m512i lo_low = broadcast_4_bytes(row), hi_low = broadcast_4_bytes(row + kGroup);
          const __m512i lo_high = broadcast_4_bytes(row + 16), hi_high = broadcast_4_bytes(row + kGroup + 16);
          for (int n = 0; n < NR; ++n) {
            lo[m][n] = _mm512_dpbusd_epi32(lo[m][n], lo_low, low[n]);
            hi[m][n] = _mm512_dpbusd_epi32(hi[m][n], low[n], hi_low);
            lo[m][n] = _mm512_dpbusd_epi32(lo[m][n], lo_high, high[n]);
            hi[m][n] = _mm512_dpbusd_epi32(hi[m][n], high[n], hi_high);
          }
        }
      }
      __m512i dots[MR][NR];
      const uint8_t* scales_of[NR];
      for (int n = 0; n < NR; ++n) {
        scales_of[n] = panel + n * panel_bytes + kCodeBytes;
        for (int m = 0; m < MR; ++m) dots[m][n] = _mm512_add_epi32(_mm512_slli_epi32(hi[m][n], 8), lo[m][n]);
      }
      add_block<MR, NR, true>(acc, dots, scales_of, scales, offset_terms, blocks, b, m0);
    }
    store<MR, NR>(acc, bias, y, N, n0, m0);
  }
};

struct Q8 {
  static constexpr int64_t kCodeBytes = 16 * 32;
  static constexpr int64_t kBlockBytes = kCodeBytes + kPanel * 2;  // codes, scales
  // Measured on an AVX-512 EPYC (one thread), 2 rows of 4 chains ran at 260-280 GFLOP/s at
  // 64-512 rows, against 180-215 for 8 rows of 1 chain and 230-250 for 3 rows of 2.
  static constexpr int kRows = 2, kPanels = 1;
  static constexpr int kChains = 4;

  // Rows m0 .. m0 + MR of x (int16) against panel n0 / 16.
  template <int MR, int NR>
  static void tile(const uint8_t* panel, int64_t, const uint8_t* x, const float* scales, const float* offset_terms,
                   const float* bias, float* y, int64_t K, int64_t N, int64_t n0, int64_t m0) {
    static_assert(NR == 1, "one panel a tile");
    const int64_t blocks = K / kGroup;
    __m512 acc[MR][1];
    for (auto& row : acc) row[0] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, panel += kBlockBytes) {
      __m512i chains[kChains][MR];
      for (auto& chain : chains)
        for (auto& c : chain) c = _mm512_setzero_si512();
      for (int half = 0; half < 2; ++half) {  // inputs 0..15, then 16..31: 8 weight registers at a time
        __m512i w[8];
        for (int j = 0; j < 8; ++j) w[j] = _mm512_cvtepi8_epi16(load_chunk(panel + 32 * (8 * half + j)));
        for (int j = 0; j < 8; ++j)
          for (int m = 0; m < MR; ++m) {
            const __m512i pair = broadcast_4_bytes(x + ((m0 + m) * K + b * kGroup + 16 * half + 2 * j) * 2);
            chains[j % kChains][m] = _mm512_dpwssd_epi32(chains[j % kChains][m], w[j], pair);
          }
      }
      __m512i dots[MR][1];
      for (int m = 0; m < MR; ++m) {
        dots[m][0] = chains[0][m];
        for (int c = 1; c < kChains; ++c) dots[m][0] = _mm512_add_epi32(dots[m][0], chains[c][m]);
      }
      const uint8_t* const scales_of[1] = {panel + kCodeBytes};
      add_block<MR, 1, false>(acc, dots, scales_of, scales, offset_terms, blocks, b, m0);
    }
    store<MR, 1>(acc, bias, y, N, n0, m0);
  }
};

// Rows m0 .. m0 + MR over panels first .. last: Format::kPanels at a time, then one at a time.
template <class Format, int MR>
void rows_over_run(const uint8_t* panels, int64_t panel_bytes, int64_t first, int64_t last, const uint8_t* x,
                   const float* scales, const float* offset_terms, const float* bias, float* y, int64_t K, int64_t N,
                   int64_t m0) {
  int64_t p = first;
  for (; p + Format::kPanels <= last; p += Format::kPanels)
    Format::template tile<MR, Format::kPanels>(panels + p * panel_bytes, panel_bytes, x, scales, offset_terms, bias,
                                               y, K, N, p * kPanel, m0);
  for (; p < last; ++p)
    Format::template tile<MR, 1>(panels + p * panel_bytes, panel_bytes, x, scales, offset_terms, bias, y, K, N,
                                 p * kPanel, m0);
}

// The rows after the last whole tile of rows: a tile of exactly `rows` (< Format::kRows).
template <class Format, int MR = Format::kRows - 1>
void last_rows(int64_t rows, const uint8_t* panels, int64_t panel_bytes, int64_t first, int64_t last,
               const uint8_t* x, const float* scales, const float* offset_terms, const float* bias, float* y,
               int64_t K, int64_t N, int64_t m0) {
  if constexpr (MR > 0) {
    if (rows == MR)
      rows_over_run<Format, MR>(panels, panel_bytes, first, last, x, scales, offset_terms, bias, y, K, N, m0);
    else
      last_rows<Format, MR - 1>(rows, panels, panel_bytes, first, last, x, scales, offset_terms, bias, y, K, N, m0);
  }
}

// Panels are taken in runs of up to kRunPanels, each run's weights staying in L2 while every
// row of x passes over them: a row's outputs are then written a run (4 KB) at a time, not
// 64 bytes at a time down a column of y. For a 49152-row LM head at 256 rows (2 threads),
// panel by panel took 73 ms against 55 for oneDNN's float32 GEMM; in runs, 43 against 50.
constexpr int64_t kRunPanels = 64;

template <class Format>
void linear(const uint8_t* x, const float* scales, const float* offset_terms, const uint8_t* panels,
            const float* bias, float* y, int64_t M, int64_t K, int64_t N, int threads) {
  const int64_t panel_bytes = (K / kGroup) * Format::kBlockBytes;
  const int64_t count = N / kPanel;
  // Short runs where there are few panels, so that every thread gets some; whole tiles of panels.
  const int64_t run = std::max<int64_t>(
      Format::kPanels, std::min<int64_t>(kRunPanels, count / threads) / Format::kPanels * Format::kPanels);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t first = 0; first < count; first += run) {
    const int64_t last = std::min(count, first + run);
    int64_t m0 = 0;
    for (; m0 + Format::kRows <= M; m0 += Format::kRows)
      rows_over_run<Format, Format::kRows>(panels, panel_bytes, first, last, x, scales, offset_terms, bias, y, K, N,
                                           m0);
    last_rows<Format>(M - m0, panels, panel_bytes, first, last, x, scales, offset_terms, bias, y, K, N, m0);
  }
}

// Row m's block b of x [M, K] as int16 values q into xq (Split: the block's 32 low bytes of q,
// unsigned, then its 32 high bytes, signed; else 32 int16), with its scale a (amax / 32767)
// into scales [M, K / 32] and a * (the sum of its q) into offset_terms, which the offsets multiply.
template <bool Split>
void quantize_rows(const float* x, uint8_t* xq, float* scales, float* offset_terms, int64_t M, int64_t K,
                   int threads) {
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
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(qlo)),
                                         _mm512_cvtepi32_epi16(qhi), 1);
    __m256i* block = reinterpret_cast<__m256i*>(xq + i * 2 * kGroup);
    if constexpr (Split) {
      _mm256_storeu_si256(block, _mm512_cvtepi16_epi8(q));                            // q & 255
      _mm256_storeu_si256(block + 1, _mm512_cvtepi16_epi8(_mm512_srai_epi16(q, 8)));  // q >> 8
    } else {
      _mm512_storeu_si512(block, q);
    }
    scales[i] = scale;
    offset_terms[i] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
}

}  // namespace

// x quantized for the 4-bit and the 8-bit kernel: xq [M, K] int16's bytes.
extern "C" void q16_quantize_split(const float* x, uint8_t* xq, float* scales, float* offset_terms, int64_t M,
                                   int64_t K, int threads) {
  quantize_rows<true>(x, xq, scales, offset_terms, M, K, threads);
}

extern "C" void q16_quantize_rows(const float* x, uint8_t* xq, float* scales, float* offset_terms, int64_t M,
                                  int64_t K, int threads) {
  quantize_rows<false>(x, xq, scales, offset_terms, M, K, threads);
}

// x quantized by q16_quantize_split (4-bit) or q16_quantize_rows (8-bit); panels
// [N / 16, K / 32, block bytes] uint8 as described above; bias [N] float32 or null; y [M, N]
// float32. N a multiple of 16, K of 32. Runs of panels are split over `threads` OpenMP threads.
extern "C" void q4_vnni_linear(const uint8_t* xq, const float* scales, const float* offset_terms,
                               const uint8_t* panels, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                               int threads) {
  linear<Q4>(xq, scales, offset_terms, panels, bias, y, M, K, N, threads);
}

extern "C" void q8_vnni_linear(const uint8_t* xq, const float* scales, const float* offset_terms,
                               const uint8_t* panels, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                               int threads) {
  linear<Q8>(xq, scales, offset_terms, panels, bias, y, M, K, N, threads);
}
