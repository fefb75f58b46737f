#include "parallel.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace shardadam {

// Blocks per thread. A thread that shares its core with another process's
// busy thread (torch's OpenMP workers spin for a while after each parallel
// op) gets through fewer blocks; the others take the rest, instead of all
// waiting for the slowest fixed share.
constexpr int64_t kBlocksPerThread = 8;

namespace {

// [Note: CPU thread pool] Starting and joining 15 threads took about 0.3 ms
// per call on a 16-core host (benchmarks/RESULTS.md, "CPU thread pool"), once
// per bucket of a host step. So the helpers live in a pool and sleep on a
// condition variable between calls (no spinning: they take no core from
// torch's threads or the GIL's holder). The pool is built for safety first:
// - The caller takes blocks too and only waits for the helpers that started
//   on its call: a helper that reaches a call after its blocks are all taken
//   finds it closed and does nothing. So a busy or missing pool makes a call
//   slower, never stuck, and calls from several threads at once (or nested
//   in fn) each finish on their own.
// - fork() keeps only the forking thread: the child starts a pool of its own
//   (the parent's, its lock possibly held at the fork, is left untouched).
// - The pool grows to the largest count asked for and is never torn down:
//   its idle threads end with the process.
struct Call {
  std::function<void()> work;  // takes blocks until none is left; never throws
  std::mutex m;
  std::condition_variable idle;
  int running = 0;      // helpers inside work
  bool closed = false;  // the caller has finished its share: no helper starts
  std::exception_ptr error;

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(m);
    if (!error) error = e;
  }
};

class Pool {
 public:
  // Hands `call` to up to `helpers` pool threads.
  void offer(const std::shared_ptr<Call>& call, int helpers) {
    {
      std::lock_guard<std::mutex> lock(m_);
      while (int(threads_) < helpers) {
        std::thread(&Pool::serve, this).detach();
        ++threads_;
      }
      for (int i = 0; i < helpers; ++i) queue_.push_back(call);
    }
    for (int i = 0; i < helpers; ++i) ready_.notify_one();
  }

 private:
  void serve() {
    for (;;) {
      std::shared_ptr<Call> call;
      {
        std::unique_lock<std::mutex> lock(m_);
        ready_.wait(lock, [&] { return !queue_.empty(); });
        call = std::move(queue_.front());
        queue_.pop_front();
      }
      {
        std::lock_guard<std::mutex> lock(call->m);
        if (call->closed) continue;
        ++call->running;
      }
      call->work();
      std::lock_guard<std::mutex> lock(call->m);
      if (--call->running == 0) call->idle.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable ready_;
  std::deque<std::shared_ptr<Call>> queue_;
  size_t threads_ = 0;
};

std::atomic<Pool*> pool{nullptr};

Pool& the_pool() {
  static std::once_flag once;
  std::call_once(once, [] {
    pool.store(new Pool());
    pthread_atfork(nullptr, nullptr, [] { pool.store(new Pool()); });
  });
  return *pool.load();
}

}  // namespace

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
  auto call = std::make_shared<Call>();
  call->work = [&, c = call.get()] {
    try {
      for (size_t b = next.fetch_add(1, std::memory_order_relaxed); b + 1 < cuts.size();
           b = next.fetch_add(1, std::memory_order_relaxed))
        fn(cuts[b], cuts[b + 1]);
    } catch (...) {
      next.store(cuts.size(), std::memory_order_relaxed);  // nobody takes another block
      c->fail(std::current_exception());
    }
  };
  const int helpers = int(std::min<int64_t>(threads, int64_t(cuts.size()) - 1)) - 1;
  the_pool().offer(call, helpers);
  call->work();
  std::unique_lock<std::mutex> lock(call->m);
  call->closed = true;
  call->idle.wait(lock, [&] { return call->running == 0; });
  if (call->error) std::rethrow_exception(call->error);
}

}  // namespace shardadam
