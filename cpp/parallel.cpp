#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace shardadam {

// Blocks per thread. A thread that shares its core with another process's
// busy thread (torch's OpenMP workers spin for a while after each parallel
// op) gets through fewer blocks; the others take the rest, instead of all
// waiting for the slowest fixed share.
constexpr int64_t kBlocksPerThread = 8;

void parallel_for(int64_t begin, int64_t end, int threads,
                  const std::function<int64_t(int64_t)>& weight,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (end <= begin) return;
  if (threads <= 1 || end - begin == 1) {
    fn(begin, end);
    return;
  }
  const int64_t blocks = int64_t(threads) * kBlocksPerThread;
  int64_t total = 0;
  for (int64_t i = begin; i < end; ++i) total += weight(i);
  std::vector<int64_t> cuts{begin};
  int64_t acc = 0;
  for (int64_t i = begin; i + 1 < end && int64_t(cuts.size()) < blocks; ++i) {
    acc += weight(i);
    if (acc * blocks >= total * int64_t(cuts.size())) cuts.push_back(i + 1);
  }
  cuts.push_back(end);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t b = next.fetch_add(1, std::memory_order_relaxed); b + 1 < cuts.size();
         b = next.fetch_add(1, std::memory_order_relaxed))
      fn(cuts[b], cuts[b + 1]);
  };
  const int spawned = int(std::min<int64_t>(threads, int64_t(cuts.size()) - 1)) - 1;
  std::vector<std::thread> workers;
  for (int t = 0; t < spawned; ++t) workers.emplace_back(work);
  work();
  for (std::thread& w : workers) w.join();
}

}  // namespace shardadam
