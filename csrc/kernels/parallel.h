// Splitting a kernel's independent items (rows, sequences, chunks of values) over the kernels' worker pool
// (kernels/worker_pool.h): the calling thread and the pool's helpers claim chunks of items from an atomic counter, so
// a thread the OS has descheduled delays the call by at most the chunk it holds, not by its whole share.
#pragma once

#include <cstddef>
#include <memory>
#include <type_traits>

namespace ringserve::kernels {

// Elementwise and per-row kernels below this many values stay on the calling thread: waking a second one costs more
// than it saves.
constexpr std::size_t kParallelValues = std::size_t{1} << 14;

// for_each_item's chunks per thread: enough that the others can take over a late thread's share, few enough that
// claiming them costs nothing next to the items.
constexpr std::size_t kChunksPerThread = 8;

// Runs body(context, first, last) over [0, count) in chunks of `chunk` items on the calling thread and up to
// threads - 1 helpers of the process's pool (kernels/worker_pool.cpp); rethrows the first exception a chunk threw.
void run_chunks(std::size_t count, std::size_t chunk, int threads, void (*body)(void*, std::size_t, std::size_t),
                void* context);

namespace detail {

template <class Fn>
void call_items(void* fn, std::size_t first, std::size_t last) {
  auto& call = *static_cast<std::remove_reference_t<Fn>*>(fn);
  for (std::size_t i = first; i < last; ++i) call(i);
}

template <class Fn>
void split_items(std::size_t count, std::size_t chunk, int threads, Fn& fn) {
  run_chunks(count, chunk, threads, &detail::call_items<Fn&>, const_cast<void*>(static_cast<const void*>(std::addressof(fn))));
}

}  // namespace detail

// Calls fn(i) once for every i in [0, count): over `threads` threads in chunks of contiguous items (about
// kChunksPerThread per thread) when `worth_splitting` and there are at least two threads and two items; else in order
// here. Items of about equal cost.
template <class Fn>
void for_each_item(std::size_t count, int threads, bool worth_splitting, Fn&& fn) {
  if (worth_splitting && threads >= 2 && count >= 2) {
    const std::size_t per_chunk = count / (static_cast<std::size_t>(threads) * kChunksPerThread);
    detail::split_items(count, per_chunk == 0 ? 1 : per_chunk, threads, fn);
    return;
  }
  for (std::size_t i = 0; i < count; ++i) fn(i);
}

// The same with items handed out one at a time as threads free up (items of unequal cost; put the costliest first).
template <class Fn>
void for_each_item_dynamic(std::size_t count, int threads, bool worth_splitting, Fn&& fn) {
  if (worth_splitting && threads >= 2 && count >= 2) {
    detail::split_items(count, 1, threads, fn);
    return;
  }
  for (std::size_t i = 0; i < count; ++i) fn(i);
}

}  // namespace ringserve::kernels
