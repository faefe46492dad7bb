// Paged attention for decode rows (one query token each), float32, read in place.
//
// The torch path gathers every request's K and V blocks into a padded copy before
// attending; for decode that copy is most of the memory traffic. This reads each block
// where it lies in the cache, once, with an online softmax over chunks of keys.
//
// Within a chunk, eight keys are scored at a time: each key's dot product stays a vector
// of partial sums until one transpose-and-add finishes all eight, and their exponentials
// are taken together; a key's value row is then added into every query head of its group
// with the head's accumulators held in registers.
//
// Layouts:
//   query [num_tokens, num_heads, head_dim], rows query_stride apart (a view of the fused
//   QKV projection); out the same shape, contiguous
//   key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables [num_seqs_in_table, table_stride] (int64)
//   rows, seqs, seq_lens: per decode i, its row in query/out, its row in block_tables, and
//   its context length (keys, this step's included).
// head_dim is a multiple of 8 and at most kMaxHeadDim; a kv head serves at most kMaxGroup
// query heads. Work is split by (decode, kv head) pairs in [first, last), so callers can
// run disjoint ranges on several threads.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "simd_math.h"

namespace {

constexpr int kMaxGroup = 16;
constexpr int kMaxHeadDim = 256;
constexpr int kChunk = 64;  // keys scored before their values are summed
constexpr int kSpan = 64;   // dims of one accumulator pass: 8 registers

inline __m256 lane_indices() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }

// One key's dot product with q, as 8 partial sums.
inline __m256 partial_dot(const float* q, const float* k, int64_t head_dim) {
  __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
  __m256 b = _mm256_setzero_ps();
  int64_t d = 8;
  for (; d + 16 <= head_dim; d += 16) {
    b = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), b);
    a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a);
  }
  if (d < head_dim) b = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), b);
  return _mm256_add_ps(a, b);
}

// acc[0 .. 8 NV) += sum_j weights[j] * values[rows[j] .. rows[j] + 8 NV), accumulated in registers.
template <int NV>
inline void add_values(float* acc, const float* weights, const float* values, const int64_t* rows, int64_t n) {
  __m256 sum[NV];
  for (int t = 0; t < NV; ++t) sum[t] = _mm256_loadu_ps(acc + 8 * t);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w = _mm256_broadcast_ss(weights + j);
    const float* v = values + rows[j];
    for (int t = 0; t < NV; ++t) sum[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * t), sum[t]);
  }
  for (int t = 0; t < NV; ++t) _mm256_storeu_ps(acc + 8 * t, sum[t]);
}

void add_values_span(float* acc, const float* weights, const float* values, const int64_t* rows, int64_t n,
                     int64_t vectors) {
  switch (vectors) {
    case 8: add_values<8>(acc, weights, values, rows, n); break;
    case 7: add_values<7>(acc, weights, values, rows, n); break;
    case 6: add_values<6>(acc, weights, values, rows, n); break;
    case 5: add_values<5>(acc, weights, values, rows, n); break;
    case 4: add_values<4>(acc, weights, values, rows, n); break;
    case 3: add_values<3>(acc, weights, values, rows, n); break;
    case 2: add_values<2>(acc, weights, values, rows, n); break;
    default: add_values<1>(acc, weights, values, rows, n); break;
  }
}

}  // namespace

extern "C" void paged_decode_attention(const float* query, float* out, const float* key_cache,
                                       const float* value_cache, const int64_t* block_tables, int64_t table_stride,
                                       int64_t query_stride, const int64_t* rows, const int64_t* seqs,
                                       const int64_t* seq_lens, int64_t num_heads, int64_t num_kv_heads,
                                       int64_t head_dim, int64_t block_size, float scale, int64_t first,
                                       int64_t last) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  alignas(32) float acc[kMaxGroup][kMaxHeadDim];
  alignas(32) float scores[kMaxGroup][kChunk];
  float maxes[kMaxGroup], sums[kMaxGroup];
  int64_t offsets[2][kChunk];  // this chunk's rows and the next one's
  // Where a chunk's key and value rows lie (offsets into either cache), prefetched: they
  // sit in scattered blocks, where the hardware's prefetcher loses the stream, so the next
  // chunk's rows are requested while this one's are scored. Returns the chunk's length.
  auto locate = [&](int64_t item, int64_t chunk, int64_t* into) -> int64_t {
    const int64_t i = item / num_kv_heads, kv = item % num_kv_heads;
    const int64_t* table = block_tables + seqs[i] * table_stride;
    const int64_t n = seq_lens[i] - chunk < kChunk ? seq_lens[i] - chunk : kChunk;
    // Stepping through the blocks: a division per key cost more than scoring it.
    int64_t block = chunk / block_size, in_block = chunk % block_size;
    for (int64_t j = 0; j < n; ++j) {
      into[j] = table[block] * block_stride + in_block * token_stride + kv * head_dim;
      for (int64_t d = 0; d < head_dim; d += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(key_cache + into[j] + d), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(value_cache + into[j] + d), _MM_HINT_T0);
      }
      if (++in_block == block_size) in_block = 0, ++block;
    }
    return n;
  };
  int current = 0;
  int64_t n_next = first < last ? locate(first, 0, offsets[0]) : 0;
  for (int64_t item = first; item < last; ++item) {
    const int64_t i = item / num_kv_heads, kv = item % num_kv_heads;
    const float* q = query + rows[i] * query_stride + kv * group * head_dim;
    const int64_t len = seq_lens[i];
    for (int64_t g = 0; g < group; ++g) {
      maxes[g] = -INFINITY;
      sums[g] = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) acc[g][d] = 0.0f;
    }
    for (int64_t chunk = 0; chunk < len; chunk += kChunk) {
      const int64_t n = n_next;
      const int64_t* chunk_rows = offsets[current];
      current ^= 1;
      if (chunk + kChunk < len) {
        n_next = locate(item, chunk + kChunk, offsets[current]);
      } else if (item + 1 < last) {
        n_next = locate(item + 1, 0, offsets[current]);
      }
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * head_dim;
        __m256 chunk_max = _mm256_set1_ps(-INFINITY);
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
          __m256 partial[8];
          for (int64_t j = 0; j < 8; ++j)
            partial[j] = j0 + j < n ? partial_dot(qg, key_cache + chunk_rows[j0 + j], head_dim) : _mm256_setzero_ps();
          __m256 s = _mm256_mul_ps(simd::transpose_sum(partial), _mm256_set1_ps(scale));
          const __m256 valid = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps(static_cast<float>(j0)), lane_indices()),
                                             _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
          s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, valid);
          _mm256_store_ps(scores[g] + j0, s);
          chunk_max = _mm256_max_ps(chunk_max, s);
        }
        const float new_max = simd::horizontal_max(chunk_max);
        if (new_max > maxes[g]) {  // rescale what was summed under the old maximum
          const float correction = std::exp(maxes[g] - new_max);
          sums[g] *= correction;
          for (int64_t d = 0; d < head_dim; ++d) acc[g][d] *= correction;
          maxes[g] = new_max;
        }
        const __m256 m = _mm256_set1_ps(maxes[g]);
        __m256 total = _mm256_setzero_ps();
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
          const __m256 s = _mm256_load_ps(scores[g] + j0);
          // Keys past the chunk's end scored -inf: their weight is exactly 0, not exp's floor.
          const __m256 e = _mm256_and_ps(simd::exp(_mm256_sub_ps(s, m)),
                                         _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_GT_OQ));
          _mm256_store_ps(scores[g] + j0, e);
          total = _mm256_add_ps(total, e);
        }
        sums[g] += simd::horizontal_sum(total);
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; d += kSpan) {
          const int64_t span = head_dim - d < kSpan ? head_dim - d : kSpan;
          add_values_span(acc[g] + d, scores[g], value_cache + d, chunk_rows, n, span / 8);
        }
    }
    float* o = out + rows[i] * num_heads * head_dim + kv * group * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float inv = 1.0f / sums[g];
      for (int64_t d = 0; d < head_dim; ++d) o[g * head_dim + d] = acc[g][d] * inv;
    }
  }
}
