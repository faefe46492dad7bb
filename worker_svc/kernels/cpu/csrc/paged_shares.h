// How the paged attention kernels (paged_decode.cpp, paged_prefill.cpp) run their work: one
// thread per share (thread i takes items bounds[i] .. bounds[i + 1]), each with the head size
// as a compile-time constant where it is a common one, so that its loops unroll.
#pragma once

#include <cstdint>
#include <type_traits>

#include "parallel.h"

namespace paged_shares {

// attend(head_dim_constant, first, last) for each thread's share; head_dim_constant is a
// std::integral_constant of 64, 128 or 0 (0: any other size, read at run time).
template <class Attend>
void run(int64_t head_dim, const int64_t* bounds, int64_t threads, const Attend& attend) {
  // A share a thread; every share on the caller's where the pool runs it alone.
  parallel::for_each(static_cast<int>(threads), threads, [&](int64_t i) {
    if (head_dim == 64) {
      attend(std::integral_constant<int64_t, 64>{}, bounds[i], bounds[i + 1]);
    } else if (head_dim == 128) {
      attend(std::integral_constant<int64_t, 128>{}, bounds[i], bounds[i + 1]);
    } else {
      attend(std::integral_constant<int64_t, 0>{}, bounds[i], bounds[i + 1]);
    }
  });
}

}  // namespace paged_shares
