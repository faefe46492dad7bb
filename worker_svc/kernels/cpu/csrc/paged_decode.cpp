// Paged attention for decode rows (one query token each), float32, read in place from a cache of
// float32, bfloat16 or float16 (cache_element.h).
//
// The torch path gathers every request's K and V blocks into a padded copy before
// attending; for decode that copy is most of the memory traffic. This reads each block
// where it lies in the cache, once, with an online softmax over chunks of keys.
//
// A decode's keys are read in chunks, eight token rows (every kv head) at a time, in cache
// order: first their scores, then their values. For each query head, eight keys' dot
// products stay vectors of partial sums until one transpose-and-add finishes all eight, and
// their exponentials are taken together; value rows are added into up to three heads at
// once, with the accumulators held in registers. While one chunk is read, the next one's
// rows are prefetched, a few cache lines between passes of the computation: the blocks lie
// scattered, where the hardware's prefetcher loses the stream.
//
// Layouts:
//   query [num_tokens, num_heads, head_dim], rows query_stride apart (a view of the fused
//   QKV projection); out the same shape, contiguous
//   key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables [num_seqs_in_table, table_stride] (int64)
//   rows, seqs, seq_lens: per decode i, its row in query/out, its row in block_tables, and
//   its context length (keys, this step's included).
//   bounds [threads + 1]: thread i computes decodes [bounds[i], bounds[i + 1]).
// head_dim is a multiple of 8.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cache_element.h"
#include "paged_shares.h"
#include "simd_math.h"

namespace {

constexpr int kChunk = 64;  // keys scored before their values are summed
constexpr int kSpan = 32;   // dims of one pass over the value rows: 4 registers a head

inline __m256 lane_indices() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }

// Eight keys' dot products with q, each as a vector of 8 partial sums: q's vectors are
// loaded once for all eight, the keys' straight into the FMAs.
template <class Element>
inline void partial_dots(const float* q, const typename Element::Stored* const keys[8], int64_t head_dim,
                         __m256 partial[8]) {
  for (int j = 0; j < 8; ++j) partial[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) partial[j] = _mm256_fmadd_ps(qd, Element::load8(keys[j] + d), partial[j]);
  }
}

// The next chunk's token rows (offsets into one cache), requested a few cache lines a step,
// between the computation's own loads. A burst of a whole row group's lines at once filled
// the core's miss buffers and stalled the loads behind it until memory had answered, so
// reading and computing took turns: spread out, the 64 decodes x 30 layers of a batched
// step (416 keys on average) went from 109 to 64 ms on one thread and from 60 to 40 on
// two. (An AVX-512 build then ran no faster: the reads set the pace.) Requested into L2,
// not L1, they were read 3-7% faster on two threads at 150-768 keys a decode (alternated in
// one process, three batches; alike on one thread); a second chunk ahead into L2 as well
// made the reads 8-13% slower.
template <class Stored>
class Prefetcher {
 public:
  static constexpr int64_t kPerLine = 64 / sizeof(Stored);  // elements a cache line holds

  void start(const Stored* cache, const int64_t* rows, int64_t n, int64_t token_stride, int64_t lines_a_step) {
    cache_ = cache, rows_ = rows, n_ = n, token_stride_ = token_stride, lines_a_step_ = lines_a_step;
    row_ = 0, d_ = 0;
  }
  void step() { issue(lines_a_step_); }
  void finish() { issue(std::numeric_limits<int64_t>::max()); }  // every line left

 private:
  void issue(int64_t lines) {
    for (; lines > 0 && row_ < n_; --lines) {
      _mm_prefetch(reinterpret_cast<const char*>(cache_ + rows_[row_] + d_), _MM_HINT_T1);
      if ((d_ += kPerLine) >= token_stride_) d_ = 0, ++row_;
    }
  }
  const Stored* cache_ = nullptr;
  const int64_t* rows_ = nullptr;
  int64_t n_ = 0, token_stride_ = 0, lines_a_step_ = 0, row_ = 0, d_ = 0;
};

// For each of G heads g: acc[g][0 .. 8 NV) += sum_j weights[g][j] * values[rows[j] .. + 8 NV),
// accumulated in registers; each value vector is loaded once for the G heads it serves.
template <class Element, int G, int NV>
inline void add_values(float* const acc[], const float* const weights[], const typename Element::Stored* values,
                       const int64_t* rows, int64_t n, Prefetcher<typename Element::Stored>& prefetcher) {
  static_assert(G * NV + G + 1 <= 16, "accumulators, weights and a value vector fit AVX2's 16 registers");
  __m256 sum[G][NV];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < NV; ++t) sum[g][t] = _mm256_loadu_ps(acc[g] + 8 * t);
  for (int64_t j = 0; j < n; ++j) {
    __m256 w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm256_broadcast_ss(weights[g] + j);
    prefetcher.step();
    const auto* v = values + rows[j];
    for (int t = 0; t < NV; ++t) {
      const __m256 vt = Element::load8(v + 8 * t);
      for (int g = 0; g < G; ++g) sum[g][t] = _mm256_fmadd_ps(w[g], vt, sum[g][t]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < NV; ++t) _mm256_storeu_ps(acc[g] + 8 * t, sum[g][t]);
}

template <class Element, int G>
void add_values_span(float* const acc[], const float* const weights[], const typename Element::Stored* values,
                     const int64_t* rows, int64_t n, int64_t vectors, Prefetcher<typename Element::Stored>& prefetcher) {
  switch (vectors) {
    case 4: add_values<Element, G, 4>(acc, weights, values, rows, n, prefetcher); break;
    case 3: add_values<Element, G, 3>(acc, weights, values, rows, n, prefetcher); break;
    case 2: add_values<Element, G, 2>(acc, weights, values, rows, n, prefetcher); break;
    default: add_values<Element, G, 1>(acc, weights, values, rows, n, prefetcher); break;
  }
}

constexpr int64_t kHeadsAPass = 3;  // query heads whose values one pass over the rows adds

// The passes add_group_values makes over each value row of a kv head.
inline int64_t value_passes(int64_t group, int64_t head_dim) {
  return (group + kHeadsAPass - 1) / kHeadsAPass * ((head_dim + kSpan - 1) / kSpan);
}

// Values into the heads of one kv head's group: up to kHeadsAPass heads share each pass over
// the value rows, kSpan dims at a time.
template <class Element>
void add_group_values(float* acc, const float* weights, const typename Element::Stored* values, const int64_t* rows,
                      int64_t n, int64_t group, int64_t head_dim, Prefetcher<typename Element::Stored>& prefetcher) {
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsAPass) {
    const int64_t heads = std::min(group - g0, kHeadsAPass);
    for (int64_t d = 0; d < head_dim; d += kSpan) {
      const int64_t vectors = (head_dim - d < kSpan ? head_dim - d : kSpan) / 8;
      float* head_acc[kHeadsAPass];
      const float* head_weights[kHeadsAPass];
      for (int64_t g = 0; g < heads; ++g) {
        head_acc[g] = acc + (g0 + g) * head_dim + d;
        head_weights[g] = weights + (g0 + g) * kChunk;
      }
      static_assert(kHeadsAPass == 3, "the cases below take 1 to 3 heads");
      switch (heads) {
        case 3: add_values_span<Element, 3>(head_acc, head_weights, values + d, rows, n, vectors, prefetcher); break;
        case 2: add_values_span<Element, 2>(head_acc, head_weights, values + d, rows, n, vectors, prefetcher); break;
        default: add_values_span<Element, 1>(head_acc, head_weights, values + d, rows, n, vectors, prefetcher); break;
      }
    }
  }
}

// kHeadDim: the head size as a constant, so that a key's dot product unrolls into registers
// (0: head_dim's value, for other sizes).
template <class Element, int64_t kHeadDim>
void attend(const float* query, float* out, const typename Element::Stored* key_cache,
            const typename Element::Stored* value_cache,
            const int64_t* block_tables, int64_t table_stride, int64_t query_stride, const int64_t* rows,
            const int64_t* seqs, const int64_t* seq_lens, int64_t num_heads, int64_t num_kv_heads,
            int64_t any_head_dim, int64_t block_size, float scale, int64_t first, int64_t last) {
  const int64_t head_dim = kHeadDim ? kHeadDim : any_head_dim;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  // Per query head of the decode: its output so far, and its running max and sum of exponentials.
  std::vector<float> acc(num_heads * head_dim), scores(num_heads * kChunk), maxes(num_heads), sums(num_heads);
  int64_t offsets[2][kChunk];  // where this chunk's token rows start (in either cache), and the next one's
  // Where a chunk's token rows lie; returns the chunk's length.
  auto locate = [&](int64_t i, int64_t chunk, int64_t* into) -> int64_t {
    const int64_t* table = block_tables + seqs[i] * table_stride;
    const int64_t n = seq_lens[i] - chunk < kChunk ? seq_lens[i] - chunk : kChunk;
    // Stepping through the blocks: a division per key cost more than scoring it.
    int64_t block = chunk / block_size, in_block = chunk % block_size;
    for (int64_t j = 0; j < n; ++j) {
      into[j] = table[block] * block_stride + in_block * token_stride;
      if (++in_block == block_size) in_block = 0, ++block;
    }
    return n;
  };
  // A row's cache lines, spread over the steps that read one: the score passes of eight
  // rows (one per query head), and the value passes of a row.
  using Stored = typename Element::Stored;
  const int64_t lines = (token_stride + Prefetcher<Stored>::kPerLine - 1) / Prefetcher<Stored>::kPerLine;
  const int64_t score_lines = (8 * lines + num_heads - 1) / num_heads;
  const int64_t passes = num_kv_heads * value_passes(group, head_dim);
  const int64_t value_lines = (lines + passes - 1) / passes;
  Prefetcher<Stored> prefetcher;
  int current = 0;
  int64_t n_next = 0;
  if (first < last) {
    n_next = locate(first, 0, offsets[0]);
    for (const Stored* cache : {key_cache, value_cache}) {
      prefetcher.start(cache, offsets[0], n_next, token_stride, 0);
      prefetcher.finish();
    }
  }
  for (int64_t i = first; i < last; ++i) {
    const float* q = query + rows[i] * query_stride;
    const int64_t len = seq_lens[i];
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(maxes.begin(), maxes.end(), -INFINITY);
    std::fill(sums.begin(), sums.end(), 0.0f);
    for (int64_t chunk = 0; chunk < len; chunk += kChunk) {
      const int64_t n = n_next;
      const int64_t* chunk_rows = offsets[current];
      current ^= 1;
      const int64_t* next_rows = offsets[current];
      n_next = 0;
      if (chunk + kChunk < len) {
        n_next = locate(i, chunk + kChunk, offsets[current]);
      } else if (i + 1 < last) {
        n_next = locate(i + 1, 0, offsets[current]);
      }
      // Scores, eight token rows at a time for every query head: the rows are read from memory
      // once, then from L1.
      prefetcher.start(key_cache, next_rows, n_next, token_stride, score_lines);
      for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const __m256 valid = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps(static_cast<float>(j0)), lane_indices()),
                                           _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
        for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
          const Stored* keys = key_cache + kv * head_dim;
          const Stored* key_rows[8];  // keys past the chunk's end read its first row; their scores are masked
          for (int64_t j = 0; j < 8; ++j) key_rows[j] = keys + chunk_rows[j0 + j < n ? j0 + j : j0];
          for (int64_t g = 0; g < group; ++g) {
            prefetcher.step();
            const int64_t h = kv * group + g;
            __m256 partial[8];
            partial_dots<Element>(q + h * head_dim, key_rows, head_dim, partial);
            __m256 s = _mm256_mul_ps(simd::transpose_sum(partial), _mm256_set1_ps(scale));
            s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, valid);
            _mm256_storeu_ps(&scores[h * kChunk + j0], s);
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* head_acc = &acc[h * head_dim];
        float* head_scores = &scores[h * kChunk];
        __m256 chunk_max = _mm256_set1_ps(-INFINITY);
        for (int64_t j0 = 0; j0 < n; j0 += 8) chunk_max = _mm256_max_ps(chunk_max, _mm256_loadu_ps(head_scores + j0));
        const float new_max = simd::horizontal_max(chunk_max);
        if (new_max > maxes[h]) {  // rescale what was summed under the old maximum
          const float correction = std::exp(maxes[h] - new_max);
          sums[h] *= correction;
          for (int64_t d = 0; d < head_dim; ++d) head_acc[d] *= correction;
          maxes[h] = new_max;
        }
        const __m256 m = _mm256_set1_ps(maxes[h]);
        __m256 total = _mm256_setzero_ps();
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
          const __m256 s = _mm256_loadu_ps(head_scores + j0);
          const __m256 e = simd::masked_weight(s, m);  // keys past the chunk's end scored -inf
          _mm256_storeu_ps(head_scores + j0, e);
          total = _mm256_add_ps(total, e);
        }
        sums[h] += simd::horizontal_sum(total);
      }
      prefetcher.finish();  // the rows left where the next chunk is longer than this one
      prefetcher.start(value_cache, next_rows, n_next, token_stride, value_lines);
      for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const int64_t rows_here = std::min<int64_t>(8, n - j0);
        for (int64_t kv = 0; kv < num_kv_heads; ++kv)
          add_group_values<Element>(&acc[kv * group * head_dim], &scores[kv * group * kChunk + j0],
                           value_cache + kv * head_dim, chunk_rows + j0,
                           rows_here, group, head_dim, prefetcher);
      }
      prefetcher.finish();
    }
    float* o = out + rows[i] * num_heads * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float inv = 1.0f / sums[h];
      for (int64_t d = 0; d < head_dim; ++d) o[h * head_dim + d] = acc[h * head_dim + d] * inv;
    }
  }
}

}  // namespace

#define PAGED_DECODE_ATTENTION(dtype, Element)                                                                  \
  extern "C" void paged_decode_attention_##dtype(                                                               \
      const float* query, float* out, const void* key_cache, const void* value_cache, const int64_t* block_tables, \
      int64_t table_stride, int64_t query_stride, const int64_t* rows, const int64_t* seqs, const int64_t* seq_lens, \
      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,                \
      const int64_t* bounds, int64_t threads) {                                                                   \
    using Stored = Element::Stored;                                                                               \
    paged_shares::run(head_dim, bounds, threads, [&](auto head_dim_constant, int64_t first, int64_t last) {       \
      attend<Element, decltype(head_dim_constant)::value>(                                                        \
          query, out, static_cast<const Stored*>(key_cache), static_cast<const Stored*>(value_cache), block_tables, \
          table_stride, query_stride, rows, seqs, seq_lens, num_heads, num_kv_heads, head_dim, block_size, scale,   \
          first, last);                                                                                           \
    });                                                                                                           \
  }
KVFLEET_FOR_EACH_CACHE_ELEMENT(PAGED_DECODE_ATTENTION)
