// Small SIMD helpers shared by the float32 kernels (AVX2; exp and silu_times also AVX-512).
#pragma once

#include <immintrin.h>

#include <cmath>

namespace simd {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Lane j of the result is the sum of v[j]'s lanes: eight dot products finished at once.
inline __m256 transpose_sum(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// The lane operations exp and silu_times take, on AVX2's 8 lanes and, in a file built for
// AVX-512, its 16: lane for lane the same operations, so the same results.
template <int kLanes>
struct Lanes;

template <>
struct Lanes<8> {
  using Vector = __m256;
  static __m256 load(const float* at) { return _mm256_loadu_ps(at); }
  static void store(float* at, __m256 v) { _mm256_storeu_ps(at, v); }
  static __m256 set1(float v) { return _mm256_set1_ps(v); }
  static __m256 min(__m256 a, __m256 b) { return _mm256_min_ps(a, b); }
  static __m256 max(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
  static __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
  static __m256 sub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
  static __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
  static __m256 div(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
  static __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 fnmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
  static __m256 round(__m256 a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // Lane for lane, a <= b ? if_true : if_false, and a > b ? if_true : 0 (for NaN, as false).
  static __m256 where_less_equal(__m256 a, __m256 b, __m256 if_true, __m256 if_false) {
    return _mm256_blendv_ps(if_false, if_true, _mm256_cmp_ps(a, b, _CMP_LE_OQ));
  }
  static __m256 where_greater(__m256 a, __m256 b, __m256 if_true) {
    return _mm256_and_ps(if_true, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
  }
  // 2^n for whole n within float32's exponents.
  static __m256 exp2(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
};

#ifdef __AVX512F__
template <>
struct Lanes<16> {
  using Vector = __m512;
  static __m512 load(const float* at) { return _mm512_loadu_ps(at); }
  static void store(float* at, __m512 v) { _mm512_storeu_ps(at, v); }
  static __m512 set1(float v) { return _mm512_set1_ps(v); }
  static __m512 min(__m512 a, __m512 b) { return _mm512_min_ps(a, b); }
  static __m512 max(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
  static __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
  static __m512 sub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
  static __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
  static __m512 div(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
  static __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
  static __m512 fnmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
  static __m512 round(__m512 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static __m512 where_less_equal(__m512 a, __m512 b, __m512 if_true, __m512 if_false) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LE_OQ), if_false, if_true);
  }
  static __m512 where_greater(__m512 a, __m512 b, __m512 if_true) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), if_true);
  }
  static __m512 exp2(__m512 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
};
#endif

// e^x for x in float32's range, Cephes' polynomial (about 1 ulp); x is clamped to where e^x is
// finite and normal, so e^x is about 1e-38, not 0, below -87.
template <class V>
inline V exp(V x) {
  using L = Lanes<sizeof(V) / sizeof(float)>;
  x = L::min(L::max(x, L::set1(-87.3f)), L::set1(88.3f));
  const V n = L::round(L::mul(x, L::set1(1.44269504088896341f)));
  x = L::fnmadd(n, L::set1(0.693359375f), x);  // x - n ln2, ln2 in two parts
  x = L::fnmadd(n, L::set1(-2.12194440e-4f), x);
  V p = L::set1(1.9875691500e-4f);
  p = L::fmadd(p, x, L::set1(1.3981999507e-3f));
  p = L::fmadd(p, x, L::set1(8.3334519073e-3f));
  p = L::fmadd(p, x, L::set1(4.1665795894e-2f));
  p = L::fmadd(p, x, L::set1(1.6666665459e-1f));
  p = L::fmadd(p, x, L::set1(5.0000001201e-1f));
  p = L::fmadd(p, L::mul(x, x), L::add(x, L::set1(1.0f)));
  return L::mul(p, L::exp2(n));
}

// silu(gate) * up = gate / (1 + e^-gate) * up.
template <class V>
inline V silu_times(V gate, V up) {
  using L = Lanes<sizeof(V) / sizeof(float)>;
  const V e = exp(L::sub(L::set1(0.0f), gate));
  return L::mul(L::div(gate, L::add(L::set1(1.0f), e)), up);
}

// A softmax weight e^(s - max), exactly 0 for a masked score (s = -inf) rather than exp's floor.
template <class V>
inline V masked_weight(V s, V max) {
  using L = Lanes<sizeof(V) / sizeof(float)>;
  return L::where_greater(s, L::set1(-INFINITY), exp(L::sub(s, max)));
}

}  // namespace simd
