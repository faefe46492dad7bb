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
// The integer dots run on VPDPBUSD (unsigned by signed bytes, 64 products an instruction):
// each q is stored as two unsigned bytes, lo = q & 255 and hi = (q >> 8) + 128 (per row and
// block: the 32 lo bytes, then the 32 hi bytes), and the codes are the signed bytes, so
//   sum code * q = 256 * (sum code * hi - 128 * sum code) + sum code * lo
// takes two instructions per 64 products, as VPDPWSSD on int16 pairs would, but 4-bit codes
// need only a mask or a shift and 8-bit ones nothing, not a widening to int16 (on a 2-core
// Xeon with two VNNI instructions a cycle, the widening held VPDPWSSD to 37% of its peak).
//
// Weights are repacked in panels of 16 output rows, so that one 32-bit lane holds one output
// row and a block's 32 inputs need no horizontal sums; lane r's four bytes of a "quad" are
// row r's inputs 4 * j .. 4 * j + 3. Per panel and block: the codes (4-bit: four 64-byte
// chunks, chunk g holding quad g in its low nibbles and quad g + 4 in its high ones; 8-bit:
// eight chunks, chunk j quad j), the 16 scales (float16), the 16 offsets (float16, 4-bit
// only), then each row's sum of codes (int16). A step of many rows first widens each run of
// 4-bit panels it takes into a thread's buffer, a code a byte (Q4Bytes): a tile then reads
// its codes as it reads 8-bit ones, where unpacking them a tile at a time was an eighth of
// the instructions.
//
// Built with KVFLEET_AMX (a second build, for CPUs with AMX-INT8), steps of kWidenRows rows
// or more take the same dots on AMX tiles, 16 rows at a time: the same integers, scaled in
// the same order, so the output is the VNNI kernel's to the bit.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#ifdef KVFLEET_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "parallel.h"
#include "quantized_rows.h"
#include "thread_buffer.h"

namespace {

using quantized_rows::kGroup;  // inputs per GGUF block
constexpr int64_t kPanel = 16;  // output rows per panel: one per 32-bit lane of a zmm

inline __m256i load_chunk(const uint8_t* at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)); }

// -128 times 16 int16 sums of codes, as int32.
inline __m512i minus_128_times(const uint8_t* sums) {
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_cvtepi16_epi32(load_chunk(sums)), 7));
}

inline __m512i broadcast_4_bytes(const uint8_t* at) {
  int32_t four;
  std::memcpy(&four, at, sizeof(four));
  return _mm512_set1_epi32(four);
}

struct Q4 {
  static constexpr int64_t kCodeBytes = 4 * 64;
  static constexpr bool kOffsets = true;
  static constexpr int64_t kSumBytes = 2 * kPanel;
  // Quads g and g + 4 of a block (g < 4): chunk g's low and high nibbles.
  static void quads(const uint8_t* codes, int g, __m512i& first, __m512i& second) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), chunk = _mm512_loadu_si512(codes + 64 * g);
    first = _mm512_and_si512(chunk, nibble);
    second = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), nibble);
  }
  static __m512i hi_start(const uint8_t* sums) { return minus_128_times(sums); }
};

struct Q8 {
  static constexpr int64_t kCodeBytes = 8 * 64;
  static constexpr bool kOffsets = false;
  static constexpr int64_t kSumBytes = 2 * kPanel;
  static void quads(const uint8_t* codes, int g, __m512i& first, __m512i& second) {
    first = _mm512_loadu_si512(codes + 64 * g);
    second = _mm512_loadu_si512(codes + 64 * (g + 4));
  }
  static __m512i hi_start(const uint8_t* sums) { return minus_128_times(sums); }
};

// A run of Q4 panels widened (widen_run) for the many rows that pass over it: a code a byte,
// as Q8's, and -128 times each row's sum of codes as int32, what its hi dots start from.
struct Q4Bytes {
  static constexpr int64_t kCodeBytes = Q8::kCodeBytes;
  static constexpr bool kOffsets = true;
  static constexpr int64_t kSumBytes = 4 * kPanel;
  static void quads(const uint8_t* codes, int g, __m512i& first, __m512i& second) { Q8::quads(codes, g, first, second); }
  static __m512i hi_start(const uint8_t* sums) { return _mm512_loadu_si512(sums); }
};

template <class Format>
struct Layout {
  static constexpr int64_t kScales = Format::kCodeBytes;
  static constexpr int64_t kOffsets = kScales + 2 * kPanel;
  static constexpr int64_t kCodeSums = kOffsets + (Format::kOffsets ? 2 * kPanel : 0);
  static constexpr int64_t kBlockBytes = kCodeSums + Format::kSumBytes;
};

// One call's activations (quantize_rows), bias and output.
struct Call {
  const uint8_t* x;
  const float* scales;
  const float* offset_terms;
  const float* bias;
  float* y;
  int64_t M, K, N;
};

// A weight block's 16 scales and offsets (zero where its format has none), in float32.
template <class Format>
struct BlockScales {
  __m512 d, offset;
  explicit BlockScales(const uint8_t* block)
      : d(_mm512_cvtph_ps(load_chunk(block + Layout<Format>::kScales))),
        offset(Format::kOffsets ? _mm512_cvtph_ps(load_chunk(block + Layout<Format>::kOffsets)) : _mm512_setzero_ps()) {}
};

// acc plus a block's dots (lo, hi as tile() sums them) times its scales, for x's row and block
// `at`: the scales' products in float32, in one order whatever the tile or the instructions
// that summed the dots.
template <class Format>
inline __m512 scaled(const BlockScales<Format>& w, const Call& c, int64_t at, __m512i lo, __m512i hi, __m512 acc) {
  const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w.d, _mm512_set1_ps(c.scales[at])), acc);
  if constexpr (Format::kOffsets) acc = _mm512_fmadd_ps(w.offset, _mm512_set1_ps(c.offset_terms[at]), acc);
  return acc;
}

// y[m, n0 .. n0 + 16] = acc + bias.
inline void store(const Call& c, int64_t m, int64_t n0, __m512 acc) {
  const __m512 add = c.bias ? _mm512_loadu_ps(c.bias + n0) : _mm512_setzero_ps();
  _mm512_storeu_ps(c.y + m * c.N + n0, _mm512_add_ps(acc, add));
}

// The next tile of panels, requested into L2 a few cache lines a block while this one's rows
// are computed: a decode step's weights come from memory, read once, where the hardware's
// prefetcher, following two panels' streams, left the tiles waiting for them.
struct Ahead {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t lines_a_block = 0;
  void step() {
    for (int64_t i = 0; i < lines_a_block && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// Activation rows and panels per tile: 4 x 2 ran the 4-bit projections at 230-255 GFLOP/s (2
// threads, 64-2048 rows), 3 x 3 and 2 x 3 alike, 4 x 1 at 145-185, 2 x 1 at 120-155.
constexpr int kTileRows = 4, kTilePanels = 2;

// Rows m0 .. m0 + MR of x against the NR panels from `panel` (panel_bytes apart): y[m, n0 .. n0 + 16 NR].
template <class Format, int MR, int NR>
void tile(const uint8_t* panel, int64_t panel_bytes, const Call& c, int64_t n0, int64_t m0, Ahead& ahead) {
  using L = Layout<Format>;
  const int64_t blocks = c.K / kGroup;
  __m512 acc[MR][NR];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, panel += L::kBlockBytes) {
    // sum code * lo, and sum code * hi less the 128 * sum code that hi's +128 adds: two chains an output
    __m512i lo[MR][NR], hi[MR][NR];
    ahead.step();
    for (int n = 0; n < NR; ++n) {
      const __m512i start = Format::hi_start(panel + n * panel_bytes + L::kCodeSums);
      for (int m = 0; m < MR; ++m) lo[m][n] = _mm512_setzero_si512(), hi[m][n] = start;
    }
    for (int g = 0; g < 4; ++g) {
      __m512i first[NR], second[NR];  // quads g and g + 4
      for (int n = 0; n < NR; ++n) Format::quads(panel + n * panel_bytes, g, first[n], second[n]);
      for (int m = 0; m < MR; ++m) {
        const uint8_t* row = c.x + ((m0 + m) * blocks + b) * 2 * kGroup + 4 * g;
        const __m512i lo_first = broadcast_4_bytes(row), hi_first = broadcast_4_bytes(row + kGroup);
        const __m512i lo_second = broadcast_4_bytes(row + 16), hi_second = broadcast_4_bytes(row + kGroup + 16);
        for (int n = 0; n < NR; ++n) {
          lo[m][n] = _mm512_dpbusd_epi32(lo[m][n], lo_first, first[n]);
          hi[m][n] = _mm512_dpbusd_epi32(hi[m][n], hi_first, first[n]);
          lo[m][n] = _mm512_dpbusd_epi32(lo[m][n], lo_second, second[n]);
          hi[m][n] = _mm512_dpbusd_epi32(hi[m][n], hi_second, second[n]);
        }
      }
    }
    for (int n = 0; n < NR; ++n) {
      const BlockScales<Format> w(panel + n * panel_bytes);
      for (int m = 0; m < MR; ++m) acc[m][n] = scaled(w, c, (m0 + m) * blocks + b, lo[m][n], hi[m][n], acc[m][n]);
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) store(c, m0 + m, n0 + kPanel * n, acc[m][n]);
}

#ifdef KVFLEET_AMX
constexpr bool kAmx = true;
constexpr int64_t kAmxRows = 16;  // rows of x a tile multiplies: an AMX tile's 16 rows

// The AMX tiles, configured on the calling thread for the object's life and released after it
// (a thread holding none is not saved and restored with them): tmm0 and tmm1 16 rows' lo and
// hi bytes of a block, tmm2 a panel's codes of it (8 quads of 64 bytes, the layout AMX
// reads), tmm3 and tmm4 their dots for even blocks, tmm5 and tmm6 for odd ones.
class AmxTiles {
 public:
  AmxTiles() {
    struct {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t bytes_a_row[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int t : {0, 1}) config.rows[t] = kAmxRows, config.bytes_a_row[t] = kGroup;
    config.rows[2] = kGroup / 4, config.bytes_a_row[2] = 64;
    for (int t : {3, 4, 5, 6}) config.rows[t] = kAmxRows, config.bytes_a_row[t] = 64;
    _tile_loadconfig(&config);
  }
  ~AmxTiles() { _tile_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

using AmxDots = int32_t[2][kAmxRows][kPanel];  // a block's lo and hi dots, a row of 16 outputs each

// Block b's dots into `dots` on the tiles LO and HI: x's rows m0 .. m0 + 16 by one panel. A
// macro: the intrinsics take the tiles' numbers as literals.
#define KVFLEET_AMX_DOTS(LO, HI, panel, c, m0, b, dots)                                       \
  do {                                                                                        \
    const uint8_t* x_ = (c).x + (m0) * 2 * (c).K + (b) * 2 * kGroup;                          \
    _tile_zero(LO);                                                                           \
    _tile_zero(HI);                                                                           \
    _tile_loadd(0, x_, 2 * (c).K);                                                            \
    _tile_loadd(1, x_ + kGroup, 2 * (c).K);                                                   \
    _tile_loadd(2, (panel) + (b) * Layout<Format>::kBlockBytes, 64);                          \
    _tile_dpbusd(LO, 0, 2);                                                                   \
    _tile_dpbusd(HI, 1, 2);                                                                   \
    _tile_stored(LO, (dots)[0], 4 * kPanel);                                                  \
    _tile_stored(HI, (dots)[1], 4 * kPanel);                                                  \
  } while (false)

// Rows m0 .. m0 + 16 of x against one panel (codes a byte: Q8's layout): y[m, n0 .. n0 + 16],
// each block's dots on the tiles while the last block's are scaled, as tile()'s are.
template <class Format>
void amx_tile(const uint8_t* panel, const Call& c, int64_t n0, int64_t m0) {
  using L = Layout<Format>;
  const int64_t blocks = c.K / kGroup;
  alignas(64) AmxDots dots[2];
  __m512 acc[kAmxRows];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const auto scale = [&](int64_t b) {
    const uint8_t* block = panel + b * L::kBlockBytes;
    const __m512i hi_start = Format::hi_start(block + L::kCodeSums);
    const BlockScales<Format> w(block);
    const AmxDots& d = dots[b & 1];
    for (int m = 0; m < kAmxRows; ++m)
      acc[m] = scaled(w, c, (m0 + m) * blocks + b, _mm512_load_si512(d[0][m]),
                      _mm512_add_epi32(hi_start, _mm512_load_si512(d[1][m])), acc[m]);
  };
  KVFLEET_AMX_DOTS(3, 4, panel, c, m0, 0, dots[0]);
  for (int64_t b = 0; b < blocks; b += 2) {
    if (b + 1 < blocks) KVFLEET_AMX_DOTS(5, 6, panel, c, m0, b + 1, dots[1]);
    scale(b);
    if (b + 1 >= blocks) break;
    if (b + 2 < blocks) KVFLEET_AMX_DOTS(3, 4, panel, c, m0, b + 2, dots[0]);
    scale(b + 1);
  }
  for (int m = 0; m < kAmxRows; ++m) store(c, m0 + m, n0, acc[m]);
}

// Rows m_first .. m_first + 16 k of x over a run of `count` panels: 16 rows' blocks stay in L1
// while the run's panels, in L2, pass.
template <class Format>
void amx_rows_over_panels(const uint8_t* panels, int64_t panel_bytes, int64_t first, int64_t count, const Call& c,
                          int64_t m_first, int64_t m_last) {
  const AmxTiles tiles;
  for (int64_t m0 = m_first; m0 + kAmxRows <= m_last; m0 += kAmxRows)
    for (int64_t p = 0; p < count; ++p) amx_tile<Format>(panels + p * panel_bytes, c, (first + p) * kPanel, m0);
}
#else
constexpr bool kAmx = false;
constexpr int64_t kAmxRows = 1;
#endif

// NR panels from `panels` (the layer's panel `first` on) over rows m_first .. m_last, kTileRows
// at a time, then the rows left in one smaller tile: the panels stay in L1 while rows pass.
template <class Format, int NR, int MR = kTileRows>
void panels_over_rows(const uint8_t* panels, int64_t panel_bytes, int64_t first, const Call& c, int64_t m_first,
                      int64_t m_last, Ahead& ahead) {
  int64_t m0 = m_first;
  for (; m0 + MR <= m_last; m0 += MR) tile<Format, MR, NR>(panels, panel_bytes, c, first * kPanel, m0, ahead);
  if constexpr (MR > 1)
    if (m0 < m_last) panels_over_rows<Format, NR, MR - 1>(panels, panel_bytes, first, c, m0, m_last, ahead);
}

// Rows m_first .. m_last of x over a run of `count` panels from `panels` (the layer's panel
// `first` on), kTilePanels at a time, then one at a time; with `prefetch`, each tile of
// panels requests the next while its rows are computed.
// With `amx`, the rows' whole tiles of 16 go to AMX (a Format of a code a byte only).
template <class Format>
void rows_over_panels(const uint8_t* panels, int64_t panel_bytes, int64_t first, int64_t count, const Call& c,
                      int64_t m_first, int64_t m_last, bool prefetch, bool amx) {
#ifdef KVFLEET_AMX
  if constexpr (Format::kCodeBytes == Q8::kCodeBytes)
    if (amx) {
      const int64_t whole = m_first + (m_last - m_first) / kAmxRows * kAmxRows;
      amx_rows_over_panels<Format>(panels, panel_bytes, first, count, c, m_first, whole);
      m_first = whole;
      if (m_first == m_last) return;
    }
#endif
  const int64_t tile_bytes = kTilePanels * panel_bytes;
  const int64_t steps = (m_last - m_first + kTileRows - 1) / kTileRows * (c.K / kGroup);
  const char* run_end = reinterpret_cast<const char*>(panels + count * panel_bytes);
  Ahead ahead;
  ahead.lines_a_block = prefetch ? (tile_bytes / 64 + steps - 1) / steps : 0;
  int64_t p = 0;
  for (; p + kTilePanels <= count; p += kTilePanels) {
    ahead.next = reinterpret_cast<const char*>(panels + (p + kTilePanels) * panel_bytes);
    ahead.end = std::min(run_end, ahead.next + tile_bytes);
    panels_over_rows<Format, kTilePanels>(panels + p * panel_bytes, panel_bytes, first + p, c, m_first, m_last, ahead);
  }
  ahead.next = ahead.end = nullptr;
  for (; p < count; ++p)
    panels_over_rows<Format, 1>(panels + p * panel_bytes, panel_bytes, first + p, c, m_first, m_last, ahead);
}

// Q4 panels into Q4Bytes ones at `into`: unpacked once for a run, not once a tile of rows.
void widen_run(const uint8_t* panels, int64_t count, int64_t blocks, uint8_t* into) {
  using From = Layout<Q4>;
  using To = Layout<Q4Bytes>;
  for (int64_t i = 0; i < count * blocks; ++i, panels += From::kBlockBytes, into += To::kBlockBytes) {
    for (int g = 0; g < 4; ++g) {
      __m512i first, second;
      Q4::quads(panels, g, first, second);
      _mm512_storeu_si512(into + 64 * g, first);
      _mm512_storeu_si512(into + 64 * (g + 4), second);
    }
    std::memcpy(into + To::kScales, panels + From::kScales, 4 * kPanel);  // scales and offsets
    _mm512_storeu_si512(into + To::kCodeSums, Q4::hi_start(panels + From::kCodeSums));
  }
}

// Panels are taken in runs of up to kRunPanels, each run's weights staying in L2 while every
// row of x passes over them. For a 49152-row LM head at 256 rows (2 threads), panel by panel
// over all rows took 73 ms against 55 for oneDNN's float32 GEMM; in runs, 43 against 50.
constexpr int64_t kRunPanels = 64;

// Rows of quantized x a pass takes over a run: with the run's panels they stay in L2 (2048
// rows of 576 inputs, 2.4 MB, streamed through a 2 MB L2 evicted the panels they passed;
// passes of 452 rows made them 1.15x faster).
constexpr int64_t kPassBytes = 512 << 10;

// 4-bit runs are widened (widen_run) for steps of at least this many rows: at 8-24 rows the
// widening cost more than unpacking once a tile of rows saved, at 36-64 it broke even.
constexpr int64_t kWidenRows = 48;

// Its threads' buffers (thread_buffer.h): the caller's for its quantized x, each pool thread's for the run it widens.
enum class Buffer { kQuantizedX, kWideRun };

// Runs a thread claims where x takes one pass (a decode step's): a thread that starts late
// then leaves some of its share to the others (parallel::for_each_claimed). A bigger x is
// read again for every run, so there the runs are as few as kRunPanels allows.
constexpr int64_t kRunsAThread = 4;

template <class Format>
void linear(const uint8_t* panels, const Call& c, int threads) {
  const int64_t blocks = c.K / kGroup;
  const int64_t panel_bytes = blocks * Layout<Format>::kBlockBytes;
  const int64_t count = c.N / kPanel;
  // Passes of whole tiles: of 16 rows where AMX takes them.
  const int64_t unit = std::max<int64_t>(kTileRows, kAmxRows);
  const int64_t pass_rows = std::max<int64_t>(unit, kPassBytes / (2 * c.K) / unit * unit);
  // Runs of whole tiles of panels and at most about kRunPanels, as many for every thread.
  const int64_t fewest = (count + threads * kRunPanels - 1) / (threads * kRunPanels);
  const int64_t wanted = threads * (c.M <= pass_rows ? std::max(kRunsAThread, fewest) : fewest);
  const int64_t runs = std::max<int64_t>(1, std::min(count / kTilePanels, wanted));
  const int64_t run = ((count + runs - 1) / runs + kTilePanels - 1) / kTilePanels * kTilePanels;
  // AMX reads codes a byte, as widened runs hold them: at 16 and 32 rows, widening for it cost
  // what its tiles saved.
  const bool amx = kAmx && c.M >= kWidenRows;
  const bool widen = std::is_same_v<Format, Q4> && c.M >= kWidenRows;
  const int64_t wide_panel_bytes = blocks * Layout<Q4Bytes>::kBlockBytes;
  parallel::for_each_claimed(threads, (count + run - 1) / run, [&](int64_t run_index) {
    const int64_t first = run_index * run, n = std::min(count - first, run);
    uint8_t* wide = widen ? thread_buffer<Buffer::kWideRun>(run * wide_panel_bytes) : nullptr;
    if (widen) widen_run(panels + first * panel_bytes, n, blocks, wide);
    for (int64_t m_first = 0; m_first < c.M; m_first += pass_rows) {
      const int64_t m_last = std::min(c.M, m_first + pass_rows);
      // The widened run is in L2 already; the layer's panels are not.
      if (widen)
        rows_over_panels<Q4Bytes>(wide, wide_panel_bytes, first, n, c, m_first, m_last, false, amx);
      else
        rows_over_panels<Format>(panels + first * panel_bytes, panel_bytes, first, n, c, m_first, m_last, !amx,
                                 amx);
    }
  });
}

// The source's rows quantized into the calling thread's buffer (quantized_rows.h), then
// multiplied with the panels.
template <class Format, class Source>
void quantized_linear(const Source& source, const uint8_t* panels, const float* bias, float* y, int64_t M,
                      int64_t K, int64_t N, int threads, int quantize_threads) {
  const int64_t blocks = M * (K / kGroup);
  uint8_t* xq = thread_buffer<Buffer::kQuantizedX>(M * 2 * K + 2 * blocks * int64_t{sizeof(float)});
  float* scales = reinterpret_cast<float*>(xq + M * 2 * K);
  float* offset_terms = scales + blocks;
  quantized_rows::quantize(source, xq, scales, offset_terms, M, K, quantize_threads);
  linear<Format>(panels, Call{xq, scales, offset_terms, bias, y, M, K, N}, threads);
}

}  // namespace

// y = x @ W^T + bias: x [M, K] float32 with rows x_stride apart; panels [N / 16, K / 32, block
// bytes] uint8 as described above; bias [N] float32 or null; y [M, N] float32. N a multiple of
// 16, K of 32. x is quantized on `quantize_threads` threads, and runs of panels are
// split over `threads`.
extern "C" void q4_vnni_linear(const float* x, int64_t x_stride, const uint8_t* panels, const float* bias, float* y,
                               int64_t M, int64_t K, int64_t N, int threads, int quantize_threads) {
  quantized_linear<Q4>(quantized_rows::Plain{x, x_stride}, panels, bias, y, M, K, N, threads, quantize_threads);
}

extern "C" void q8_vnni_linear(const float* x, int64_t x_stride, const uint8_t* panels, const float* bias, float* y,
                               int64_t M, int64_t K, int64_t N, int threads, int quantize_threads) {
  quantized_linear<Q8>(quantized_rows::Plain{x, x_stride}, panels, bias, y, M, K, N, threads, quantize_threads);
}

// As q4_vnni_linear, of x = silu(gate) * up for gate_up [M, 2 K] = [gate | up], rows
// gate_up_stride apart.
extern "C" void q4_vnni_linear_silu_and_mul(const float* gate_up, int64_t gate_up_stride, const uint8_t* panels,
                                            const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                                            int threads, int quantize_threads) {
  quantized_linear<Q4>(quantized_rows::SiluAndMul{gate_up, gate_up_stride, K}, panels, bias, y, M, K, N, threads,
                       quantize_threads);
}

// As q4_vnni_linear, of x = RMSNorm(h) with `norm_weight` and `eps`, where h = x + residual,
// written to `sum`, or with residual null h = x (sum unused); x, residual, sum [M, K], contiguous.
extern "C" void q4_vnni_linear_add_norm(const float* x, const float* residual, const float* norm_weight, float eps,
                                        float* sum, const uint8_t* panels, const float* bias, float* y, int64_t M,
                                        int64_t K, int64_t N, int threads, int quantize_threads) {
  quantized_linear<Q4>(quantized_rows::AddNorm{x, residual, norm_weight, sum, eps, K}, panels, bias, y, M, K, N,
                       threads, quantize_threads);
}

#ifdef KVFLEET_AMX
// Asks Linux for the AMX tile state, which it grants a process only on request: 0 if granted.
extern "C" int vnni_amx_request() {
  constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return static_cast<int>(syscall(SYS_arch_prctl, kRequestPermission, kTileData));
}
#endif
