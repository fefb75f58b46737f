// Split a range of chunks across CPU threads by element count. Threads are
// started per call and joined before returning: no pool to outlive a fork()
// (DataLoader workers), and for work large enough to be split the start cost
// (tens of microseconds) is small next to the work.
#pragma once

#include <cstdint>
#include <functional>

namespace shardadam {

// Calls fn(begin, end) on disjoint sub-ranges of [begin, end) covering it,
// blocks of about equal weight(i) that up to `threads` threads (the caller's
// included) take in turn, so a slowed thread does fewer of them.
void parallel_for(int64_t begin, int64_t end, int threads,
                  const std::function<int64_t(int64_t)>& weight,
                  const std::function<void(int64_t, int64_t)>& fn);

}  // namespace shardadam
