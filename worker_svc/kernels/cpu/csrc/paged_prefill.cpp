// Paged attention for prompt chunks (any number of query tokens each), float32, read in place from
// a cache of float32, bfloat16 or float16 (cache_element.h): a 16-bit block's key and value rows
// are widened once into the tile's scratch, where the inner loops read float32 as they do a
// float32 cache's rows.
//
// A chunk's queries attend causally to everything cached before them and to the chunk's own
// keys, all of which the cache writer has put in the paged cache by now; so a chunk that
// continues a cached prefix needs no gathered copy of its context and no mask tensor, and a
// whole prompt is the case with nothing cached before it.
//
// Work comes in tiles: up to kRows rows of one chunk that share a kv head, a row being one
// query token's one query head. The tile holds its rows in vector lanes (its queries
// transposed, scale folded in, once a tile) and walks the keys 0 .. its last row's position
// in blocks of kBlock, reading each key and value row where it lies in the cache:
//   scores   S[key][row] = sum_d K[key][d] Q[d][row]   kKeys keys x kRows rows in registers
//   softmax  running max and sum per row (per lane), rows past their position masked
//   values   O[d][row] += sum_key V[key][d] P[key][row] kDims dims x kRows rows in registers
// Every inner loop is broadcast-one-value, FMA-into-three-vectors: no horizontal sums and
// no transposed copy of the keys.
//
// Layouts:
//   query [num_tokens, num_heads, head_dim], rows query_stride apart (a view of the fused
//   QKV projection); out the same shape, contiguous
//   key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables [num_seqs_in_table, table_stride] (int64)
//   chunks [num_chunks, 4] (int64): first row in query/out, query tokens, context length
//   (keys, the chunk's own included), row in block_tables
//   tiles [num_tiles, 3] (int64): chunk, kv head, first row (query token t, head g of the
//   group is row t * group + g)
//   bounds [threads + 1]: thread i computes tiles [bounds[i], bounds[i + 1]).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cache_element.h"
#include "paged_shares.h"
#include "simd_math.h"

namespace {

// A vector's lanes: AVX-512's where the file is built for it (-march=native on a CPU that has
// it), else AVX2's. A tile's rows are its queries in vector lanes, so its size follows.
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
using L = simd::Lanes<kLanes>;
using Vector = L::Vector;
constexpr int kVectors = 3;                  // a tile's rows: three vectors' lanes
constexpr int kRows = kVectors * kLanes;
constexpr int kKeys = 4;                     // keys scored at once: 4 x 3 accumulators
constexpr int kDims = 4;                     // dims of the output summed at once: 4 x 3 accumulators
constexpr int kBlock = 64;                   // keys scored before their values are summed
constexpr float kNoMax = -1e30f;             // a row's max before any key: finite, so no inf - inf

struct Tile {
  // [head_dim][kRows]: the rows' queries times the scale, lanes by row
  std::vector<float> query;
  // [head_dim][kRows]: the rows' outputs so far, under their running maxes
  std::vector<float> out;
  // [kBlock][kRows]: the current block's scores, then their exponentials
  std::vector<float> weights;
  // [kBlock][head_dim] each: a 16-bit cache's block of key and value rows, as float32
  std::vector<float> keys, values;
  Vector max[kVectors], sum[kVectors], position[kVectors];
};

// acc[k][v] = sum_d key_k[d] * query[d][v-th vector]
template <int64_t kHeadDim>
inline void score_keys(const float* const keys[kKeys], const float* query, int64_t any_head_dim, Vector acc[][kVectors]) {
  const int64_t head_dim = kHeadDim ? kHeadDim : any_head_dim;
  Vector sums[kKeys][kVectors];  // local, so they stay in registers: acc's stores would be reloaded
  for (int k = 0; k < kKeys; ++k)
    for (int v = 0; v < kVectors; ++v) sums[k][v] = L::set1(0.0f);
  for (int64_t d = 0; d < head_dim; ++d) {
    Vector q[kVectors];
    for (int v = 0; v < kVectors; ++v) q[v] = L::load(query + d * kRows + v * kLanes);
    for (int k = 0; k < kKeys; ++k) {
      const Vector key = L::set1(keys[k][d]);
      for (int v = 0; v < kVectors; ++v) sums[k][v] = L::fmadd(key, q[v], sums[k][v]);
    }
  }
  for (int k = 0; k < kKeys; ++k)
    for (int v = 0; v < kVectors; ++v) acc[k][v] = sums[k][v];
}

// out[d0 .. d0 + kDims)[rows] = correction * out + sum_j value_j[d] * weights[j][rows]
inline void add_values(float* out, const float* const values[], const float* weights, int64_t n, int64_t d0,
                       const Vector correction[kVectors]) {
  Vector acc[kDims][kVectors];
  for (int i = 0; i < kDims; ++i)
    for (int v = 0; v < kVectors; ++v)
      acc[i][v] = L::mul(L::load(out + (d0 + i) * kRows + v * kLanes), correction[v]);
  for (int64_t j = 0; j < n; ++j) {
    Vector w[kVectors];
    for (int v = 0; v < kVectors; ++v) w[v] = L::load(weights + j * kRows + v * kLanes);
    for (int i = 0; i < kDims; ++i) {
      const Vector value = L::set1(values[j][d0 + i]);
      for (int v = 0; v < kVectors; ++v) acc[i][v] = L::fmadd(value, w[v], acc[i][v]);
    }
  }
  for (int i = 0; i < kDims; ++i)
    for (int v = 0; v < kVectors; ++v) L::store(out + (d0 + i) * kRows + v * kLanes, acc[i][v]);
}

// One block of keys [first, first + n): scores, the softmax update, values.
template <int64_t kHeadDim>
void attend_block(Tile& tile, const float* const keys[kBlock], const float* const values[kBlock], int64_t first,
                  int64_t n, int64_t head_dim) {
  for (int64_t j = 0; j < n; j += kKeys) {
    Vector acc[kKeys][kVectors];
    const int64_t here = std::min<int64_t>(kKeys, n - j);
    const float* scored[kKeys];  // past the block's end, its last key again: those scores are not kept
    for (int64_t k = 0; k < kKeys; ++k) scored[k] = keys[j + std::min(k, here - 1)];
    score_keys<kHeadDim>(scored, tile.query.data(), head_dim, acc);
    for (int64_t k = 0; k < here; ++k) {
      // A row sees key first + j + k when its position is at least that.
      const Vector key_position = L::set1(static_cast<float>(first + j + k));
      for (int v = 0; v < kVectors; ++v)
        L::store(&tile.weights[(j + k) * kRows + v * kLanes],
                 L::where_less_equal(key_position, tile.position[v], acc[k][v], L::set1(-INFINITY)));
    }
  }
  Vector correction[kVectors];
  for (int v = 0; v < kVectors; ++v) {
    Vector block_max = L::set1(kNoMax);
    for (int64_t j = 0; j < n; ++j) block_max = L::max(block_max, L::load(&tile.weights[j * kRows + v * kLanes]));
    const Vector new_max = L::max(tile.max[v], block_max);
    correction[v] = simd::exp(L::sub(tile.max[v], new_max));
    tile.max[v] = new_max;
    Vector total = L::set1(0.0f);
    for (int64_t j = 0; j < n; ++j) {
      float* w = &tile.weights[j * kRows + v * kLanes];
      const Vector e = simd::masked_weight(L::load(w), new_max);
      L::store(w, e);
      total = L::add(total, e);
    }
    tile.sum[v] = L::fmadd(tile.sum[v], correction[v], total);
  }
  for (int64_t d0 = 0; d0 < head_dim; d0 += kDims)
    add_values(tile.out.data(), values, tile.weights.data(), n, d0, correction);
}

template <class Element, int64_t kHeadDim>
void attend(const float* query, float* out, const typename Element::Stored* key_cache,
            const typename Element::Stored* value_cache,
            const int64_t* block_tables, int64_t table_stride, int64_t query_stride, const int64_t* chunks,
            const int64_t* tiles, int64_t num_heads, int64_t num_kv_heads, int64_t any_head_dim, int64_t block_size,
            float scale, int64_t first_tile, int64_t last_tile) {
  const int64_t head_dim = kHeadDim ? kHeadDim : any_head_dim;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  constexpr bool widened = !std::is_same_v<Element, cache_element::Float32>;
  const int64_t scratch = widened ? kBlock * head_dim : 0;
  Tile tile{std::vector<float>(head_dim * kRows), std::vector<float>(head_dim * kRows),
            std::vector<float>(kBlock * kRows), std::vector<float>(scratch), std::vector<float>(scratch), {}, {}, {}};
  const float* keys[kBlock];
  const float* values[kBlock];
  for (int64_t t = first_tile; t < last_tile; ++t) {
    const int64_t* chunk = chunks + tiles[3 * t] * 4;
    const int64_t first_token_row = chunk[0], num_tokens = chunk[1], context = chunk[2];
    const int64_t* table = block_tables + chunk[3] * table_stride;
    const int64_t kv = tiles[3 * t + 1], first_row = tiles[3 * t + 2];
    const int64_t rows = std::min<int64_t>(kRows, num_tokens * group - first_row);
    // Token t of the chunk sits at position context - num_tokens + t; rows past the tile's end see no key.
    float positions[kRows];
    std::fill(tile.query.begin(), tile.query.end(), 0.0f);
    for (int64_t r = 0; r < kRows; ++r) {
      positions[r] = -1.0f;
      if (r >= rows) continue;
      const int64_t token = (first_row + r) / group, head = kv * group + (first_row + r) % group;
      positions[r] = static_cast<float>(context - num_tokens + token);
      const float* q = query + (first_token_row + token) * query_stride + head * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) tile.query[d * kRows + r] = q[d] * scale;
    }
    std::fill(tile.out.begin(), tile.out.end(), 0.0f);
    for (int v = 0; v < kVectors; ++v) {
      tile.position[v] = L::load(positions + v * kLanes);
      tile.max[v] = L::set1(kNoMax);
      tile.sum[v] = L::set1(0.0f);
    }
    const int64_t num_keys = context - num_tokens + (first_row + rows - 1) / group + 1;
    for (int64_t first = 0; first < num_keys; first += kBlock) {
      const int64_t n = std::min<int64_t>(kBlock, num_keys - first);
      // Stepping through the blocks: a division per key cost more than reading it.
      int64_t block = first / block_size, in_block = first % block_size;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t offset = (table[block] * block_size + in_block) * token_stride + kv * head_dim;
        if constexpr (widened) {
          keys[j] = &tile.keys[j * head_dim];
          values[j] = &tile.values[j * head_dim];
          cache_element::load<Element>(&tile.keys[j * head_dim], key_cache + offset, head_dim);
          cache_element::load<Element>(&tile.values[j * head_dim], value_cache + offset, head_dim);
        } else {
          keys[j] = key_cache + offset;
          values[j] = value_cache + offset;
        }
        if (++in_block == block_size) in_block = 0, ++block;
      }
      attend_block<kHeadDim>(tile, keys, values, first, n, head_dim);
    }
    float sums[kRows];
    for (int v = 0; v < kVectors; ++v) L::store(sums + v * kLanes, tile.sum[v]);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = (first_row + r) / group, head = kv * group + (first_row + r) % group;
      float* o = out + ((first_token_row + token) * num_heads + head) * head_dim;
      const float inverse = 1.0f / sums[r];
      for (int64_t d = 0; d < head_dim; ++d) o[d] = tile.out[d * kRows + r] * inverse;
    }
  }
}

}  // namespace

#define PAGED_PREFILL_ATTENTION(dtype, Element)                                                                 \
  extern "C" void paged_prefill_attention_##dtype(                                                              \
      const float* query, float* out, const void* key_cache, const void* value_cache, const int64_t* block_tables, \
      int64_t table_stride, int64_t query_stride, const int64_t* chunks, const int64_t* tiles, int64_t num_heads,  \
      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, const int64_t* bounds,             \
      int64_t threads) {                                                                                           \
    using Stored = Element::Stored;                                                                               \
    paged_shares::run(head_dim, bounds, threads, [&](auto head_dim_constant, int64_t first, int64_t last) {       \
      attend<Element, decltype(head_dim_constant)::value>(                                                        \
          query, out, static_cast<const Stored*>(key_cache), static_cast<const Stored*>(value_cache), block_tables, \
          table_stride, query_stride, chunks, tiles, num_heads, num_kv_heads, head_dim, block_size, scale, first,   \
          last);                                                                                                  \
    });                                                                                                           \
  }
KVFLEET_FOR_EACH_CACHE_ELEMENT(PAGED_PREFILL_ATTENTION)

// The rows (query token x query head) of a tile, as the caller splits a chunk's rows.
extern "C" int64_t paged_prefill_tile_rows() { return kRows; }
