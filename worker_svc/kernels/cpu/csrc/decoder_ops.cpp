// The float32 elementwise work between a CPU decoder's matmuls, one pass each: the residual
// add with RMSNorm, the rotary embedding, SiLU-and-multiply, and writing new K and V into
// the paged cache (in its element type). torch runs each as several operators, and under OMP_WAIT_POLICY=PASSIVE
// each of them over 32k elements woke the second thread (~0.1 ms); here a call stays on the
// calling thread unless `threads` says otherwise, and then runs on kvfleet's pool (parallel.h).
//
// Built with -ffp-contract=off: each product and sum is rounded as torch's operators round
// them, so the add and the rotary embedding equal torch's bit for bit. The norm's sum of
// squares and SiLU's exp differ from torch's in the last bits (another summation order,
// another exp polynomial).
#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cache_element.h"
#include "parallel.h"
#include "simd_math.h"

namespace {

inline float silu_times(float gate, float up) { return gate / (1.0f + std::exp(-gate)) * up; }

}  // namespace

// out = weight * (h / sqrt(mean(h^2) + eps)) per row, where h = x + residual (written to
// `sum`) or, with residual null, h = x. x, residual, sum, out: [rows, hidden], contiguous rows.
extern "C" void add_rms_norm(const float* x, const float* residual, const float* weight, float* sum, float* out,
                             int64_t rows, int64_t hidden, float eps, int threads) {
  parallel::for_each(threads, rows, [&](int64_t r) {
    const float* xr = x + r * hidden;
    const float* h = xr;
    if (residual != nullptr) {
      const float* rr = residual + r * hidden;
      float* sr = sum + r * hidden;
      int64_t i = 0;
      for (; i + 8 <= hidden; i += 8)
        _mm256_storeu_ps(sr + i, _mm256_add_ps(_mm256_loadu_ps(rr + i), _mm256_loadu_ps(xr + i)));
      for (; i < hidden; ++i) sr[i] = rr[i] + xr[i];
      h = sr;
    }
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= hidden; i += 16) {
      const __m256 a = _mm256_loadu_ps(h + i), b = _mm256_loadu_ps(h + i + 8);
      acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(a, a));
      acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(b, b));
    }
    float squares = simd::horizontal_sum(_mm256_add_ps(acc0, acc1));
    for (; i < hidden; ++i) squares += h[i] * h[i];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
    const __m256 inv8 = _mm256_set1_ps(inv);
    float* o = out + r * hidden;
    for (i = 0; i + 8 <= hidden; i += 8)
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(h + i), inv8)));
    for (; i < hidden; ++i) o[i] = weight[i] * (h[i] * inv);
  });
}

// silu(gate) * up written over gate, where row r of gate_up is [gate | up], each `width` wide.
extern "C" void silu_and_mul(float* gate_up, int64_t rows, int64_t width, int threads) {
  parallel::for_each(threads, rows, [&](int64_t r) {
    float* gate = gate_up + r * 2 * width;
    const float* up = gate + width;
    int64_t i = 0;
    for (; i + 8 <= width; i += 8)
      _mm256_storeu_ps(gate + i, simd::silu_times(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    for (; i < width; ++i) gate[i] = silu_times(gate[i], up[i]);
  });
}

// Neox-style rotary embedding in place: for each head, (a, b) = its two halves,
// a' = a cos - b sin and b' = b cos + a sin, as x * cos + rotate_half(x) * sin computes them.
// q [tokens, q_heads, dim] and k [tokens, k_heads, dim] have row strides q_stride and
// k_stride (views into the fused QKV output); cos and sin [positions, dim] repeat their halves.
extern "C" void rotary(float* q, float* k, const int64_t* positions, const float* cos, const float* sin,
                       int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t dim, int64_t q_stride,
                       int64_t k_stride, int threads) {
  const int64_t half = dim / 2;
  parallel::for_each(threads, tokens, [&](int64_t t) {
    const float* c = cos + positions[t] * dim;
    const float* s = sin + positions[t] * dim;
    for (int64_t h = 0; h < q_heads + k_heads; ++h) {
      float* a = h < q_heads ? q + t * q_stride + h * dim : k + t * k_stride + (h - q_heads) * dim;
      float* b = a + half;
      int64_t i = 0;
      for (; i + 8 <= half; i += 8) {
        const __m256 va = _mm256_loadu_ps(a + i), vb = _mm256_loadu_ps(b + i);
        const __m256 ca = _mm256_loadu_ps(c + i), sa = _mm256_loadu_ps(s + i);
        const __m256 cb = _mm256_loadu_ps(c + half + i), sb = _mm256_loadu_ps(s + half + i);
        _mm256_storeu_ps(a + i, _mm256_sub_ps(_mm256_mul_ps(va, ca), _mm256_mul_ps(vb, sa)));
        _mm256_storeu_ps(b + i, _mm256_add_ps(_mm256_mul_ps(vb, cb), _mm256_mul_ps(va, sb)));
      }
      for (; i < half; ++i) {
        const float va = a[i], vb = b[i];
        a[i] = va * c[i] - vb * s[i];
        b[i] = vb * c[half + i] + va * s[half + i];
      }
    }
  });
}

// Token t's K and V rows (`width` floats each, at row strides key_stride and value_stride)
// to slot slots[t] of the caches [num_slots, width], in the caches' element type, over
// `threads`: a prompt's first writes to the cache's pages fault them in, in parallel so. Returns
// how many slots were outside the caches: those tokens are not written.
template <class Element>
int64_t write_kv(const float* key, const float* value, typename Element::Stored* key_cache,
                 typename Element::Stored* value_cache, const int64_t* slots, int64_t tokens, int64_t width,
                 int64_t key_stride, int64_t value_stride, int64_t num_slots, int threads) {
  std::atomic<int64_t> outside{0};
  parallel::for_each(threads, tokens, [&](int64_t t) {
    if (slots[t] < 0 || slots[t] >= num_slots) {
      outside.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    cache_element::store<Element>(key_cache + slots[t] * width, key + t * key_stride, width);
    cache_element::store<Element>(value_cache + slots[t] * width, value + t * value_stride, width);
  });
  return outside.load();
}

#define WRITE_KV(dtype, Element)                                                                                  \
  extern "C" int64_t write_kv_##dtype(const float* key, const float* value, void* key_cache, void* value_cache,  \
                                      const int64_t* slots, int64_t tokens, int64_t width, int64_t key_stride,   \
                                      int64_t value_stride, int64_t num_slots, int threads) {                    \
    using Stored = Element::Stored;                                                                               \
    return write_kv<Element>(key, value, static_cast<Stored*>(key_cache), static_cast<Stored*>(value_cache),    \
                             slots, tokens, width, key_stride, value_stride, num_slots, threads);                 \
  }
KVFLEET_FOR_EACH_CACHE_ELEMENT(WRITE_KV)
