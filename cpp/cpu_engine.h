// The CPU multi-tensor engine: chunks spread over threads, each chunk walked
// in tiles of kCpuTile elements that are converted to float arrays, handed to
// the op's shared math (which the compiler vectorises over the tile), and
// converted back.
#pragma once

#include "ops.h"
#include "parallel.h"

namespace shardadam {

constexpr int kCpuTile = 256;

template <int L, int K>
class CpuIO {
 public:
  CpuIO(const TableView& tv, uint32_t tensor) {
    for (int l = 0; l < L; ++l) {
      ptr_[l] = reinterpret_cast<char*>(tv.ptrs[int64_t(l) * tv.num_tensors + tensor]);
      dtype_[l] = DType(tv.dtypes[int64_t(l) * tv.num_tensors + tensor]);
    }
  }
  void at(int64_t index, int count) {
    index_ = index;
    count_ = count;
  }
  DType dtype(int l) const { return dtype_[l]; }
  int count() const { return count_; }

  void load(int l, float (&out)[K]) const {
    switch (dtype_[l]) {
      case DType::F32: {
        const float* s = reinterpret_cast<const float*>(ptr_[l]) + index_;
        for (int k = 0; k < count_; ++k) out[k] = s[k];
        break;
      }
      case DType::BF16: {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(ptr_[l]) + index_;
        for (int k = 0; k < count_; ++k) out[k] = bf16_to_float(s[k]);
        break;
      }
      case DType::F16: {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(ptr_[l]) + index_;
        for (int k = 0; k < count_; ++k) out[k] = f16_to_float(s[k]);
        break;
      }
      default:
        for (int k = 0; k < count_; ++k) out[k] = 0.0f;
    }
    for (int k = count_; k < K; ++k) out[k] = 0.0f;
  }

  void store(int l, const float (&in)[K]) const {
    switch (dtype_[l]) {
      case DType::F32: {
        float* d = reinterpret_cast<float*>(ptr_[l]) + index_;
        for (int k = 0; k < count_; ++k) d[k] = in[k];
        break;
      }
      case DType::BF16: {
        uint16_t* d = reinterpret_cast<uint16_t*>(ptr_[l]) + index_;
        for (int k = 0; k < count_; ++k) d[k] = float_to_bf16(in[k]);
        break;
      }
      case DType::F16: {
        uint16_t* d = reinterpret_cast<uint16_t*>(ptr_[l]) + index_;
        for (int k = 0; k < count_; ++k) d[k] = float_to_f16(in[k]);
        break;
      }
      default:
        break;
    }
  }

  void load_bits(int l, uint16_t (&out)[K]) const {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(ptr_[l]) + index_;
    for (int k = 0; k < count_; ++k) out[k] = s[k];
    for (int k = count_; k < K; ++k) out[k] = 0;
  }

  void store_bits(int l, const uint16_t (&in)[K]) const {
    uint16_t* d = reinterpret_cast<uint16_t*>(ptr_[l]) + index_;
    for (int k = 0; k < count_; ++k) d[k] = in[k];
  }

 private:
  char* ptr_[L];
  DType dtype_[L];
  int64_t index_ = 0;
  int count_ = 0;
};

// One chunk is handled by one thread, so reductions are plain writes except
// for per-tensor maxima shared between chunks (and threads).
struct CpuReducer {
  void max_to(float* addr, float v) const {
    // Non-negative floats order like their bit patterns.
    uint32_t* word = reinterpret_cast<uint32_t*>(addr);
    const uint32_t bits = float_bits(v);
    uint32_t cur = __atomic_load_n(word, __ATOMIC_RELAXED);
    while (bits > cur &&
           !__atomic_compare_exchange_n(word, &cur, bits, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
  }
  void sum_to(float* addr, float v) const { *addr = v; }
  void flag_if(float* addr, bool v) const {
    if (v) __atomic_store_n(reinterpret_cast<uint32_t*>(addr), float_bits(1.0f), __ATOMIC_RELAXED);
  }
};

template <class Op>
void cpu_run_chunks(const TableView& tv, int64_t chunk_begin, int64_t chunk_end, const Op& op) {
  constexpr int K = kCpuTile;
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    const Chunk ch = tv.chunks[c];
    const ChunkCtx ctx{ch.tensor, tv.groups[ch.tensor], c};
    CpuIO<Op::kLists, K> io(tv, ch.tensor);
    auto state = op.template begin<K>(ctx);
    const int64_t end = ch.start + ch.len;
    for (int64_t i = ch.start; i < end; i += K) {
      io.at(i, int(end - i < K ? end - i : K));
      op.template tile<K>(io, state);
    }
    CpuReducer red;
    op.template finish<K>(ctx, state, red);
  }
}

// Below this many elements a call stays on the caller's thread.
constexpr int64_t kCpuParallelMin = int64_t(1) << 16;

template <class Op>
void cpu_apply(const TableView& tv, int64_t chunk_begin, int64_t chunk_end, const Op& op,
               const float* skip_if, int threads) {
  if (flag_is_set(skip_if) || chunk_end <= chunk_begin) return;
  int64_t work = 0;
  for (int64_t c = chunk_begin; c < chunk_end && work < kCpuParallelMin; ++c) work += tv.chunks[c].len;
  parallel_for(
      chunk_begin, chunk_end, work < kCpuParallelMin ? 1 : threads,
      [&](int64_t c) { return int64_t(tv.chunks[c].len) + 64; },  // + per-chunk overhead
      [&](int64_t b, int64_t e) { cpu_run_chunks(tv, b, e, op); });
}

}  // namespace shardadam
