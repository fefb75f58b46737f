// Split a range of chunks across CPU threads by element count, on a pool of
// threads that sleep between calls ([Note: CPU thread pool] in parallel.cpp).
#pragma once

#include <cstdint>
#include <functional>

namespace shardadam {

// Calls fn(begin, end) on disjoint sub-ranges of [begin, end) covering it,
// blocks of about equal weight(i) that up to `threads` threads (the caller's
// included) take in turn, so a slowed thread does fewer of them. Returns
// when every block is done; an exception thrown by fn on any thread is
// rethrown here (the first one), after the other threads have stopped.
void parallel_for(int64_t begin, int64_t end, int threads,
                  const std::function<int64_t(int64_t)>& weight,
                  const std::function<void(int64_t, int64_t)>& fn);

}  // namespace shardadam
