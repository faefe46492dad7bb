// A matmul's activations quantized to int16 per row and block of 32 inputs (vnni_gemm.cpp),
// from x itself or from the elementwise work that makes them, fused so that it is done
// there rather than in a pass of its own: SiLU-and-multiply before the MLP's down
// projection, the residual add and RMSNorm before the QKV and gate/up projections. Each
// computes its values as decoder_ops.cpp does, to the bit (both built with
// -ffp-contract=off), so fused and unfused steps agree exactly.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "simd_math.h"

namespace quantized_rows {

constexpr int64_t kGroup = 32;  // inputs per block

// Row m of x [M, K], rows `stride` apart.
struct Plain {
  const float* x;
  int64_t stride;

  struct Row {
    const float* at;
    void block(int64_t b, __m512& lo, __m512& hi) const {
      lo = _mm512_loadu_ps(at + b * kGroup), hi = _mm512_loadu_ps(at + b * kGroup + 16);
    }
  };
  Row row(int64_t m) const { return {x + m * stride}; }
};

// silu(gate) * up of row m of gate_up [M, 2 K] = [gate | up], rows `stride` apart.
struct SiluAndMul {
  const float* gate_up;
  int64_t stride, K;

  struct Row {
    const float* gate;
    const float* up;
    void block(int64_t b, __m512& lo, __m512& hi) const {
      const int64_t at = b * kGroup;
      lo = simd::silu_times(_mm512_loadu_ps(gate + at), _mm512_loadu_ps(up + at));
      hi = simd::silu_times(_mm512_loadu_ps(gate + at + 16), _mm512_loadu_ps(up + at + 16));
    }
  };
  Row row(int64_t m) const { return {gate_up + m * stride, gate_up + m * stride + K}; }
};

// weight * (h / sqrt(mean(h^2) + eps)) of row m, where h = x + residual (written to `sum`) or,
// with residual null, h = x; x, residual and sum [M, K], contiguous rows.
struct AddNorm {
  const float* x;
  const float* residual;
  const float* weight;
  float* sum;
  float eps;
  int64_t K;

  struct Row {
    const float* h;
    const float* weight;
    __m512 inverse;
    void block(int64_t b, __m512& lo, __m512& hi) const {
      const int64_t at = b * kGroup;
      lo = _mm512_mul_ps(_mm512_loadu_ps(weight + at), _mm512_mul_ps(_mm512_loadu_ps(h + at), inverse));
      hi = _mm512_mul_ps(_mm512_loadu_ps(weight + at + 16), _mm512_mul_ps(_mm512_loadu_ps(h + at + 16), inverse));
    }
  };

  Row row(int64_t m) const {
    const float* h = x + m * K;
    if (residual != nullptr) {
      float* s = sum + m * K;
      for (int64_t i = 0; i < K; i += 16)
        _mm512_storeu_ps(s + i, _mm512_add_ps(_mm512_loadu_ps(residual + m * K + i), _mm512_loadu_ps(h + i)));
      h = s;
    }
    // add_rms_norm's two 8-lane sums of squares are this sum's halves, added as it adds them.
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i += 16) {
      const __m512 v = _mm512_loadu_ps(h + i);
      squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));
    }
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(squares), 1));
    const float total = simd::horizontal_sum(_mm256_add_ps(_mm512_castps512_ps256(squares), high));
    const float inverse = 1.0f / std::sqrt(total / static_cast<float>(K) + eps);
    return {h, weight, _mm512_set1_ps(inverse)};
  }
};

// Row m's block b of the source's [M, K] values as int16 q, stored as bytes at xq [M, 2 K]: the
// block's 32 lo bytes (q & 255), then its 32 hi bytes ((q >> 8) + 128); its scale a (amax /
// 32767) into scales [M, K / 32] and a * (the sum of its q) into offset_terms.
template <class Source>
void quantize(const Source& source, uint8_t* xq, float* scales, float* offset_terms, int64_t M, int64_t K,
              int threads) {
  const int64_t blocks = K / kGroup;
  parallel::for_each(threads, M, [&](int64_t m) {
    const auto row = source.row(m);
    for (int64_t b = 0, i = m * blocks; b < blocks; ++b, ++i) {
      __m512 lo, hi;
      row.block(b, lo, hi);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float scale = amax / 32767.0f;
      const __m512 inverse = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
      // Round to nearest even, as the conversion does by default; |values| <= 32767.
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(qlo)),
                                           _mm512_cvtepi32_epi16(qhi), 1);
      __m256i* bytes = reinterpret_cast<__m256i*>(xq + i * 2 * kGroup);
      _mm256_storeu_si256(bytes, _mm512_cvtepi16_epi8(q));
      const __m256i high = _mm512_cvtepi16_epi8(_mm512_srai_epi16(q, 8));
      _mm256_storeu_si256(bytes + 1, _mm256_xor_si256(high, _mm256_set1_epi8(static_cast<char>(0x80))));  // + 128
      scales[i] = scale;
      offset_terms[i] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
    }
  });
}

}  // namespace quantized_rows
