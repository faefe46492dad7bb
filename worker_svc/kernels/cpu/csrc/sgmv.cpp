// LoRA's delta over a step's rows grouped by adapter, in float32 (punica's SGMV shrink and
// expand, for CPU): y[row] += (x[row] @ A[slot].T) @ B[slot].T for every row of each segment.
//
// A fused projection (q/k/v, gate/up) has `parts` modules: a slot's A stacks the parts' A
// matrices, [parts * R, in], and B, stored transposed here as Bt [parts * R, out], is
// block-diagonal: part p's output columns read only its rank columns p * R ..  p * R + rank.
// The kernel reads only those, and only the adapter's own `rank` of the R (= --max-lora-rank)
// columns each part has, so neither a smaller rank nor the fusion costs zeros.
//
// Work goes in units of up to kRows rows of one segment; a unit shrinks its rows into a small
// buffer and expands them straight into y, so units are independent and no thread waits for
// another between the shrink and the expand (each row belongs to one unit: no two write a row).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "simd_math.h"

namespace {

constexpr int kRows = 4;  // rows a unit takes: A's and Bt's loads are shared by them

struct Problem {
  const float* x;
  int64_t x_stride;
  float* y;
  int64_t y_stride;
  const int64_t* rows;       // the step's rows with an adapter, sorted by slot
  const float* a;            // [slots, parts * R, in]
  const float* bt;           // [slots, parts * R, out]
  const int64_t* part_ends;  // [parts]: the end of each part's output columns
  int64_t parts, max_rank, in, out;
};

// h[m * width + c .. c + C] = x[m] . A[c ..]: C columns at once, so that M * C FMA chains
// run side by side and each load of x serves C of them.
template <int M, int C>
void dot_columns(const Problem& p, const float* a, const float* const x[], int64_t c, float* h) {
  const int64_t width = p.parts * p.max_rank;
  __m256 acc[M][C];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < C; ++j) acc[m][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= p.in; k += 8) {
    __m256 w[C];
    for (int j = 0; j < C; ++j) w[j] = _mm256_loadu_ps(a + (c + j) * p.in + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x[m] + k);
      for (int j = 0; j < C; ++j) acc[m][j] = _mm256_fmadd_ps(xv, w[j], acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < C; ++j) {
      const float* w = a + (c + j) * p.in;
      float sum = simd::horizontal_sum(acc[m][j]);
      for (int64_t kk = k; kk < p.in; ++kk) sum += x[m][kk] * w[kk];
      h[m * width + c + j] = sum;
    }
  }
}

// h[m * width + c] = x[m] . A[c] for the first `rank` columns c of each part.
template <int M>
void shrink(const Problem& p, const float* a, const float* const x[], int64_t rank, float* h) {
  for (int64_t part = 0; part < p.parts; ++part) {
    const int64_t c0 = part * p.max_rank, c1 = c0 + rank;
    int64_t c = c0;
    for (; c + 2 <= c1; c += 2) dot_columns<M, 2>(p, a, x, c, h);
    if (c < c1) dot_columns<M, 1>(p, a, x, c, h);
  }
}

// y[m][col] += sum over part p's used rank columns c of h[m][c] * Bt[c][col].
template <int M>
void expand(const Problem& p, const float* bt, const float* h, float* const y[], int64_t rank) {
  const int64_t width = p.parts * p.max_rank;
  for (int64_t part = 0, col0 = 0; part < p.parts; col0 = p.part_ends[part++]) {
    const int64_t col1 = p.part_ends[part], c0 = part * p.max_rank, c1 = c0 + rank;
    int64_t col = col0;
    for (; col + 16 <= col1; col += 16) {  // 2 vectors of columns for each of M rows
      __m256 acc[M][2];
      for (int m = 0; m < M; ++m) {
        acc[m][0] = _mm256_loadu_ps(y[m] + col);
        acc[m][1] = _mm256_loadu_ps(y[m] + col + 8);
      }
      for (int64_t c = c0; c < c1; ++c) {
        const float* w = bt + c * p.out + col;
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        for (int m = 0; m < M; ++m) {
          const __m256 hv = _mm256_broadcast_ss(h + m * width + c);
          acc[m][0] = _mm256_fmadd_ps(hv, w0, acc[m][0]);
          acc[m][1] = _mm256_fmadd_ps(hv, w1, acc[m][1]);
        }
      }
      for (int m = 0; m < M; ++m) {
        _mm256_storeu_ps(y[m] + col, acc[m][0]);
        _mm256_storeu_ps(y[m] + col + 8, acc[m][1]);
      }
    }
    for (; col < col1; ++col) {
      for (int m = 0; m < M; ++m) {
        float sum = 0.0f;
        for (int64_t c = c0; c < c1; ++c) sum += h[m * width + c] * bt[c * p.out + col];
        y[m][col] += sum;
      }
    }
  }
}

template <int M>
void unit(const Problem& p, int64_t slot, int64_t first, int64_t rank, float* h) {
  const float* x[M];
  float* y[M];
  for (int m = 0; m < M; ++m) {
    x[m] = p.x + p.rows[first + m] * p.x_stride;
    y[m] = p.y + p.rows[first + m] * p.y_stride;
  }
  const int64_t width = p.parts * p.max_rank;
  shrink<M>(p, p.a + slot * width * p.in, x, rank, h);
  expand<M>(p, p.bt + slot * width * p.out, h, y, rank);
}

}  // namespace

// x [T, in] float32 (rows `x_stride` apart, contiguous within); y [T, out] float32, added to
// in place; rows [n]: the rows with an adapter, sorted by slot; segments [count, 4]: (slot,
// start, end, rank) over `rows`; a [slots, parts * max_rank, in]; bt [slots, parts * max_rank,
// out], both contiguous; part_ends [parts]. Units go to `threads` threads as they free up.
extern "C" void sgmv_add(const float* x, int64_t x_stride, float* y, int64_t y_stride, const int64_t* rows,
                         const int64_t* segments, int64_t count, const float* a, const float* bt,
                         const int64_t* part_ends, int64_t parts, int64_t max_rank, int64_t in, int64_t out,
                         int threads) {
  const Problem p{x, x_stride, y, y_stride, rows, a, bt, part_ends, parts, max_rank, in, out};
  std::vector<int64_t> units;  // each unit's segment and first row
  for (int64_t s = 0; s < count; ++s) {
    for (int64_t first = segments[s * 4 + 1]; first < segments[s * 4 + 2]; first += kRows) {
      units.push_back(s);
      units.push_back(first);
    }
  }
  const int64_t width = parts * max_rank;
  parallel::for_each_claimed(threads, static_cast<int64_t>(units.size() / 2), [&](int64_t i) {
    const int64_t* segment = segments + units[2 * i] * 4;
    const int64_t first = units[2 * i + 1], slot = segment[0], rank = segment[3];
    thread_local std::vector<float> h;  // the unit's shrunk rows, kRows * width
    h.resize(kRows * width);
    switch (std::min<int64_t>(kRows, segment[2] - first)) {
      case 4: unit<4>(p, slot, first, rank, h.data()); break;
      case 3: unit<3>(p, slot, first, rank, h.data()); break;
      case 2: unit<2>(p, slot, first, rank, h.data()); break;
      default: unit<1>(p, slot, first, rank, h.data()); break;
    }
  });
}
