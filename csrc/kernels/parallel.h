// Splitting a kernel's independent items (rows, sequences) over OpenMP threads. Imported after torch, the kernels
// module shares torch's libgomp (same soname), so these are torch's own intra-op threads. Builds without OpenMP
// (the sanitizer builds) run every item on the calling thread.
#pragma once

#include <cstddef>

namespace ringserve::kernels {

// Elementwise and per-row kernels below this many values stay on the calling thread: waking a second one costs more
// than it saves.
constexpr std::size_t kParallelValues = std::size_t{1} << 14;

// Calls fn(i) for every i in [0, count): split statically (each thread one contiguous range, in order) over
// `threads` threads when `worth_splitting` and there are at least two threads and two items; else in order here.
template <class Fn>
void for_each_item(std::size_t count, [[maybe_unused]] int threads, [[maybe_unused]] bool worth_splitting, Fn&& fn) {
#ifdef _OPENMP
  if (worth_splitting && threads >= 2 && count >= 2) {
    const auto n = static_cast<long>(count);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < n; ++i) fn(static_cast<std::size_t>(i));
    return;
  }
#endif
  for (std::size_t i = 0; i < count; ++i) fn(i);
}

// The same with items handed out one at a time as threads free up (items of unequal cost; put the costliest first).
template <class Fn>
void for_each_item_dynamic(std::size_t count, [[maybe_unused]] int threads, [[maybe_unused]] bool worth_splitting,
                           Fn&& fn) {
#ifdef _OPENMP
  if (worth_splitting && threads >= 2 && count >= 2) {
    const auto n = static_cast<long>(count);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long i = 0; i < n; ++i) fn(static_cast<std::size_t>(i));
    return;
  }
#endif
  for (std::size_t i = 0; i < count; ++i) fn(i);
}

}  // namespace ringserve::kernels
