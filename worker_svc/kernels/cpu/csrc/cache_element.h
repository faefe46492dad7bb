// How the paged KV cache's elements read as float32 and are written from it: float32 (the
// model's dtype, --kv-cache-dtype auto) or 16 bits (bfloat16, float16), which halve the bytes
// decode attention reads and the memory a token's KV takes. Writes round to nearest even,
// as torch's conversions do, so a cache written here equals one torch would write.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace cache_element {

struct Float32 {
  using Stored = float;
  static __m256 load8(const float* at) { return _mm256_loadu_ps(at); }
  static void store8(float* at, __m256 x) { _mm256_storeu_ps(at, x); }
};

struct BFloat16 {
  using Stored = uint16_t;
  static __m256 load8(const uint16_t* at) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store8(uint16_t* at, __m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i high = _mm256_srli_epi32(bits, 16);
    const __m256i half_ulp = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(high, _mm256_set1_epi32(1)));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, half_ulp), 16);
    // A NaN keeps its sign and becomes quiet: rounding its payload up could carry it into -0.
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
    // Eight values below 2^16 to eight uint16: packus packs within 128-bit halves.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0b1000);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm256_castsi256_si128(packed));
  }
};

struct Float16 {
  using Stored = uint16_t;
  static __m256 load8(const uint16_t* at) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  }
  static void store8(uint16_t* at, __m256 x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
};

// n elements at `at` as float32 into `to`; n need not be a multiple of 8.
template <class Element>
inline void load(float* to, const typename Element::Stored* at, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(to + i, Element::load8(at + i));
  if (i < n) {
    typename Element::Stored tail[8] = {};
    std::memcpy(tail, at + i, (n - i) * sizeof(tail[0]));
    float converted[8];
    _mm256_storeu_ps(converted, Element::load8(tail));
    std::memcpy(to + i, converted, (n - i) * sizeof(float));
  }
}

// n float32 values from `from` into the cache at `at`.
template <class Element>
inline void store(typename Element::Stored* at, const float* from, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) Element::store8(at + i, _mm256_loadu_ps(from + i));
  if (i < n) {
    float tail[8] = {};
    std::memcpy(tail, from + i, (n - i) * sizeof(float));
    typename Element::Stored converted[8];
    Element::store8(converted, _mm256_loadu_ps(tail));
    std::memcpy(at + i, converted, (n - i) * sizeof(converted[0]));
  }
}

}  // namespace cache_element

// MACRO(dtype, Element) once per element type, dtype as torch names it: each kernel defines
// an entry point per cache dtype with it, and Python picks one by the cache's dtype.
#define KVFLEET_FOR_EACH_CACHE_ELEMENT(MACRO) \
  MACRO(float32, cache_element::Float32)       \
  MACRO(bfloat16, cache_element::BFloat16)     \
  MACRO(float16, cache_element::Float16)
