#include "parallel.h"

#include <thread>
#include <vector>

namespace shardadam {

void parallel_for(int64_t begin, int64_t end, int threads,
                  const std::function<int64_t(int64_t)>& weight,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (end <= begin) return;
  if (threads <= 1 || end - begin == 1) {
    fn(begin, end);
    return;
  }
  int64_t total = 0;
  for (int64_t i = begin; i < end; ++i) total += weight(i);
  std::vector<int64_t> cuts{begin};
  int64_t acc = 0;
  for (int64_t i = begin; i < end && int64_t(cuts.size()) < threads; ++i) {
    acc += weight(i);
    if (acc * threads >= total * int64_t(cuts.size()) && i + 1 < end) cuts.push_back(i + 1);
  }
  cuts.push_back(end);
  std::vector<std::thread> workers;
  for (size_t t = 1; t + 1 < cuts.size(); ++t) workers.emplace_back(fn, cuts[t], cuts[t + 1]);
  fn(cuts[0], cuts[1]);
  for (std::thread& w : workers) w.join();
}

}  // namespace shardadam
