// y = x @ W^T + bias over GGUF blocks (4-bit projections, the 8-bit LM head) with int16
// activations, on AVX2 (no VNNI), for steps of few rows: decode.
//
// The float32 kernels (q4_gemm.cpp, q8_gemm.cpp) widen every code to a float and FMA it, about
// 20 instructions a 4-bit block before its 4 FMAs a row: a 1-row step ran at 2.5-4.5 GB/s of
// weights on one thread against 13 GB/s for a plain read; this kernel at 6.3-10.9
// (benchmarks/roofline.py, docs/cpu.md). Here x is quantized per row and block of 32 inputs to
// int16 with scale a = amax / 32767 (as vnni_gemm.cpp's, the same values to the bit), and a
// block's dot product is exact in int32:
//   sum_k (code_k * d + m) * (q_k * a) = d * a * sum_k code_k * q_k + m * a * sum_k q_k,
// with (d, m) the weight block's float16 scale and offset (Q8_0 has no offset). The codes
// are widened only to int16 (a shift, a mask and two unpacks a block) and multiplied 16 pairs at a time
// (VPMADDWD, exact: |code * q| <= 128 * 32767); the scales are applied once a block.
//
// The weights are read in the float32 kernels' layouts (PackedQ4, Q8Blocks), so a layer keeps
// one copy for both: this kernel for decode, the float32 one's dequantization for big steps.
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "parallel.h"
#include "simd_math.h"
#include "thread_buffer.h"

namespace {

constexpr int64_t kGroup = 32;  // inputs per GGUF block
constexpr int64_t kRun = 4;     // blocks whose dots are reduced together
constexpr int kTileN = 4;       // output rows a task takes

// A block's 32 weights as two vectors of 16 int16, [w0..7 | w16..23] and [w8..15 | w24..31]:
// the order unpacking bytes within 128-bit lanes gives, and so the order x is quantized in.
struct Widened {
  __m256i first, second;
};

inline __m128 halves_to_floats(uint64_t halves) { return _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(halves))); }

// 4-bit blocks as PackedQ4 lays them out: 16 bytes of codes (byte j: weight j in its low
// nibble, weight j + 16 in its high one) and a float16 (scale, offset) pair.
struct Q4 {
  const uint8_t* codes;
  const uint16_t* scale_offsets;
  Widened block(int64_t i) const {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i)));
    // Low nibbles in the low lane (weights 0..15), high ones in the high lane (16..31).
    const __m256i bytes = _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                           _mm256_set1_epi8(0x0F));
    const __m256i zero = _mm256_setzero_si256();
    return {_mm256_unpacklo_epi8(bytes, zero), _mm256_unpackhi_epi8(bytes, zero)};
  }
  // [d, m, 0, 0] of block i.
  __m128 scale_offset(int64_t i) const {
    uint32_t pair;
    std::memcpy(&pair, scale_offsets + 2 * i, sizeof(pair));
    return halves_to_floats(pair);
  }
  // [d0, m0, d1, m1 | d2, m2, d3, m3] of blocks i .. i + 3.
  __m256 scale_offsets_run(int64_t i) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale_offsets + 2 * i)));
  }
};

// 8-bit blocks as Q8Blocks holds them: codes [N, K] int8, a float16 scale a block, no offset.
struct Q8 {
  const int8_t* codes;
  const uint16_t* scales;
  Widened block(int64_t i) const {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + kGroup * i));
    const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), bytes);
    return {_mm256_unpacklo_epi8(bytes, sign), _mm256_unpackhi_epi8(bytes, sign)};
  }
  __m128 scale_offset(int64_t i) const { return halves_to_floats(scales[i]); }  // [d, 0, 0, 0]
  __m256 scale_offsets_run(int64_t i) const {
    uint64_t four;
    std::memcpy(&four, scales + i, sizeof(four));
    const __m128 d = halves_to_floats(four), zero = _mm_setzero_ps();
    return _mm256_set_m128(_mm_unpackhi_ps(d, zero), _mm_unpacklo_ps(d, zero));
  }
};

// One call's quantized activations: q [M, K] int16 (each block in Widened's order), and per
// row and block the pair (a, a * sum q) at terms [M, K / 32, 2].
struct Call {
  const int16_t* q;
  const float* terms;
  const float* bias;
  float* y;
  int64_t M, K, N;
};

// Row m of x into q and terms: a = amax / 32767, q = x * (1 / a) rounded to nearest even, as
// quantized_rows.h's quantize does.
void quantize_row(const float* x, int16_t* q, float* terms, int64_t K) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / kGroup; ++b, x += kGroup, q += kGroup) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    const float scale = simd::horizontal_max(amax) / 32767.0f;
    const __m256 inverse = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    __m256i whole[4];
    for (int j = 0; j < 4; ++j) whole[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));
    // packs_epi32(x0..7, x16..23) is [x0..3, x16..19 | x4..7, x20..23]; the permute makes it
    // [x0..7 | x16..23], Widened's first half, and the same of (x8..15, x24..31) its second.
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * h),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(whole[h], whole[h + 2]), 0xD8));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(whole[0], whole[1]), _mm256_add_epi32(whole[2], whole[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    terms[2 * b] = scale;
    terms[2 * b + 1] = scale * static_cast<float>(_mm_cvtsi128_si32(s));
  }
}

// A block's exact dot product with row q, as 8 int32 partial sums.
inline __m256i dot(const Widened& w, const int16_t* q) {
  const __m256i* at = reinterpret_cast<const __m256i*>(q);
  return _mm256_add_epi32(_mm256_madd_epi16(w.first, _mm256_loadu_si256(at)),
                          _mm256_madd_epi16(w.second, _mm256_loadu_si256(at + 1)));
}

// Four blocks' partial sums reduced to [D0, D1, D2, D3 | D0', D1', D2', D3'], D_j + D_j'
// block j's dot: one conversion and one FMA for the four, not one each.
inline __m256i reduce_run(const __m256i d[kRun]) {
  const __m256i s01 = _mm256_add_epi32(_mm256_unpacklo_epi32(d[0], d[1]), _mm256_unpackhi_epi32(d[0], d[1]));
  const __m256i s23 = _mm256_add_epi32(_mm256_unpacklo_epi32(d[2], d[3]), _mm256_unpackhi_epi32(d[2], d[3]));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
}

// Rows m0 .. m0 + MR of x against output rows n0 .. n0 + NR. Each block's (d, m) times the
// row's (a, a sum q): the even lanes scale the block's dots, the odd ones are its offset
// terms, summed apart in `offsets` (whose even lanes are unused).
template <int MR, int NR, class Weights>
void tile(const Weights& w, const Call& c, int64_t n0, int64_t m0) {
  const int64_t blocks = c.K / kGroup;
  const __m256i evens = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  __m256 acc[MR][NR], offsets[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = offsets[m][n] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + kRun <= blocks; b += kRun)
    for (int n = 0; n < NR; ++n) {
      const int64_t i = (n0 + n) * blocks + b;
      Widened run[kRun];
      for (int j = 0; j < kRun; ++j) run[j] = w.block(i + j);
      const __m256 dm = w.scale_offsets_run(i);
      for (int m = 0; m < MR; ++m) {
        const int64_t at = (m0 + m) * blocks + b;
        __m256i d[kRun];
        for (int j = 0; j < kRun; ++j) d[j] = dot(run[j], c.q + (at + j) * kGroup);
        const __m256 scaled = _mm256_mul_ps(dm, _mm256_loadu_ps(c.terms + 2 * at));
        acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce_run(d)), _mm256_permutevar8x32_ps(scaled, evens),
                                    acc[m][n]);
        offsets[m][n] = _mm256_add_ps(offsets[m][n], scaled);
      }
    }
  for (; b < blocks; ++b)  // the last K / 32 % 4 blocks, one at a time
    for (int n = 0; n < NR; ++n) {
      const int64_t i = (n0 + n) * blocks + b;
      const Widened block = w.block(i);
      const __m128 dm = w.scale_offset(i);
      for (int m = 0; m < MR; ++m) {
        const int64_t at = (m0 + m) * blocks + b;
        double pair;
        std::memcpy(&pair, c.terms + 2 * at, sizeof(pair));
        const __m128 scaled = _mm_mul_ps(dm, _mm_castpd_ps(_mm_set_sd(pair)));
        acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot(block, c.q + at * kGroup)), _mm256_broadcastss_ps(scaled),
                                    acc[m][n]);
        offsets[m][n] = _mm256_add_ps(offsets[m][n], _mm256_insertf128_ps(_mm256_setzero_ps(), scaled, 0));
      }
    }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      const __m256 odd = _mm256_blend_ps(_mm256_setzero_ps(), offsets[m][n], 0xAA);
      c.y[(m0 + m) * c.N + n0 + n] =
          simd::horizontal_sum(acc[m][n]) + simd::horizontal_sum(odd) + (c.bias ? c.bias[n0 + n] : 0.0f);
    }
}

// Output rows n0 .. n0 + NR for every row of x. One row of x takes them one after another, each
// a single stream of codes (two and four interleaved, more streams at once, read the 8-bit head
// and the 1536-wide down projection at half the rate); more rows take up to 4 at a time against
// one output row, so that each block is widened once for them.
template <int NR, class Weights>
void rows_tile(const Weights& w, const Call& c, int64_t n0) {
  if (c.M == 1) {
    for (int n = 0; n < NR; ++n) tile<1, 1>(w, c, n0 + n, 0);
    return;
  }
  for (int n = 0; n < NR; ++n) {
    int64_t m0 = 0;
    for (; m0 + 4 <= c.M; m0 += 4) tile<4, 1>(w, c, n0 + n, m0);
    switch (c.M - m0) {
      case 3: tile<3, 1>(w, c, n0 + n, m0); break;
      case 2: tile<2, 1>(w, c, n0 + n, m0); break;
      case 1: tile<1, 1>(w, c, n0 + n, m0); break;
      default: break;
    }
  }
}

// x quantized on the calling thread (a few rows: microseconds), then output rows split over `threads`.
template <class Weights>
void linear(const Weights& w, const float* x, int64_t x_stride, const float* bias, float* y, int64_t M, int64_t K,
            int64_t N, int threads) {
  const int64_t blocks = M * (K / kGroup);
  uint8_t* buffer = thread_buffer(M * K * int64_t{sizeof(int16_t)} + 2 * blocks * int64_t{sizeof(float)});
  int16_t* q = reinterpret_cast<int16_t*>(buffer);
  float* terms = reinterpret_cast<float*>(buffer + M * K * int64_t{sizeof(int16_t)});
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * x_stride, q + m * K, terms + 2 * m * (K / kGroup), K);
  const Call c{q, terms, bias, y, M, K, N};
  const int64_t tiles = N / kTileN;
  parallel::for_each(threads, tiles, [&](int64_t t) { rows_tile<kTileN>(w, c, t * kTileN); });
  for (int64_t n0 = tiles * kTileN; n0 < N; ++n0) rows_tile<1>(w, c, n0);
}

}  // namespace

// x [M, K] float32, rows x_stride apart; codes [N, K / 32, 16] uint8 and scale_offsets
// [N, K / 32, 2] float16 (PackedQ4); bias [N] float32 or null; y [M, N] float32. K a multiple of 32.
extern "C" void q4_int16_linear(const float* x, int64_t x_stride, const uint8_t* codes, const uint16_t* scale_offsets,
                                const float* bias, float* y, int64_t M, int64_t K, int64_t N, int threads) {
  linear(Q4{codes, scale_offsets}, x, x_stride, bias, y, M, K, N, threads);
}

// As q4_int16_linear over Q8_0 blocks: codes [N, K] int8, scales [N, K / 32] float16; no bias.
extern "C" void q8_int16_linear(const float* x, int64_t x_stride, const int8_t* codes, const uint16_t* scales,
                                float* y, int64_t M, int64_t K, int64_t N, int threads) {
  linear(Q8{codes, scales}, x, x_stride, nullptr, y, M, K, N, threads);
}
