// A thread's scratch buffer, kept between calls and grown as needed; one per `Tag`, so a
// kernel can keep several (the caller's for its quantized x, each pool thread's for the
// run it widens). Cache-line aligned: a tile's 64-byte loads from new[]'s 16-byte aligned
// memory each touched two lines, and steps of 512-2048 rows ran 8-16% slower (VNNI
// kernel, 2 threads, alternated in one process).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>

template <auto Tag = 0>
uint8_t* thread_buffer(int64_t bytes) {
  static thread_local std::unique_ptr<uint8_t, decltype(&std::free)> buffer{nullptr, &std::free};
  static thread_local int64_t capacity = 0;
  if (bytes > capacity) {
    capacity = (bytes + 63) / 64 * 64;  // aligned_alloc takes whole multiples of the alignment
    buffer.reset(static_cast<uint8_t*>(std::aligned_alloc(64, capacity)));
  }
  return buffer.get();
}
