// The CPU multi-tensor engine: chunks spread over threads, each chunk walked
// in tiles of kCpuTile elements that are converted to float arrays (vector
// registers for full tiles), handed to the op's shared math (which the
// compiler vectorises over the tile), and converted back.
#pragma once

#include <algorithm>

#include "cpu_gather.h"
#include "ops.h"
#include "parallel.h"

namespace shardadam {

constexpr int kCpuTile = 32;
// Tables with blockwise 8-bit lists are walked a block per tile.
constexpr int kCpuBlockTile = kQuantBlock;

// Addresses and dtypes of one tensor in every list, read once per chunk.
template <int L>
struct CpuTensor {
  CpuTensor(const TableView& tv, uint32_t tensor) : q8(tv.q8) {
    for (int l = 0; l < L; ++l) {
      ptr[l] = reinterpret_cast<char*>(tv.ptrs[int64_t(l) * tv.num_tensors + tensor]);
      dtype[l] = DType(tv.dtypes[int64_t(l) * tv.num_tensors + tensor]);
      block_list[l] = tv.block_list[l];
      all_f32 &= dtype[l] == DType::F32 || dtype[l] == DType::None;
    }
  }
  char* ptr[L];
  DType dtype[L];
  int8_t block_list[L];
  const Q8Maps* q8;
  bool all_f32 = true;  // every present list is float32
};

// One tile. Full tiles (all K elements real) have compile-time trip counts;
// the tail tile of a chunk runs the same code over count() lanes. Padded
// tiles compute all K lanes whatever count() is (padding loads as zeros and is
// never stored): blockwise tables walk every tile so, which compiles their
// large tiles once instead of twice. With
// F32Only (every list float32 or absent, the common case) loads and stores
// need no dtype dispatch, so a small tile stays in vector registers instead
// of making a round trip through the stack.
template <int L, int K, bool Full, bool F32Only = false, bool Padded = false>
class CpuIO {
 public:
  CpuIO(const CpuTensor<L>& t, int64_t index, int count) : t_(t), index_(index), count_(count) {}
  DType dtype(int l) const { return F32Only ? (t_.ptr[l] ? DType::F32 : DType::None) : t_.dtype[l]; }
  int count() const { return Full ? K : count_; }
  int lanes() const { return Full || Padded ? K : count_; }
  int64_t index() const { return index_; }  // of lane 0 in its tensor

  void load(int l, float (&out)[K]) const {
    const int n = count();
    if (Padded) for (int k = n; k < K; ++k) out[k] = 0.0f;
    if (F32Only) {
      const float* __restrict__ s = reinterpret_cast<const float*>(t_.ptr[l]) + index_;
      if (t_.ptr[l]) for (int k = 0; k < n; ++k) out[k] = s[k];
      else for (int k = 0; k < n; ++k) out[k] = 0.0f;
      return;
    }
    switch (t_.dtype[l]) {
      case DType::F32: {
        const float* s = reinterpret_cast<const float*>(t_.ptr[l]) + index_;
        for (int k = 0; k < n; ++k) out[k] = s[k];
        break;
      }
      case DType::BF16: {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(t_.ptr[l]) + index_;
        for (int k = 0; k < n; ++k) out[k] = bf16_to_float(s[k]);
        break;
      }
      case DType::F16: {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(t_.ptr[l]) + index_;
        for (int k = 0; k < n; ++k) out[k] = f16_to_float(s[k]);
        break;
      }
      case DType::F8E4M3: {
        const uint8_t* s = reinterpret_cast<const uint8_t*>(t_.ptr[l]) + index_;
        for (int k = 0; k < n; ++k) out[k] = f8e4m3_to_float(s[k]);
        break;
      }
      case DType::Q8S: case DType::Q8U: {
        const uint8_t* s = reinterpret_cast<const uint8_t*>(t_.ptr[l]) + index_;
        decode_codes(q8_map_of(*t_.q8, t_.dtype[l]).decode, s, *block_max_ptr(l), out, n);  // [Note: CPU gathers]
        break;
      }
      default:
        for (int k = 0; k < n; ++k) out[k] = 0.0f;
    }
  }

  void store(int l, const float (&in)[K]) const {
    const int n = count();
    if (F32Only) {
      float* __restrict__ d = reinterpret_cast<float*>(t_.ptr[l]) + index_;
      if (t_.ptr[l]) for (int k = 0; k < n; ++k) d[k] = in[k];
      return;
    }
    switch (t_.dtype[l]) {
      case DType::F32: {
        float* d = reinterpret_cast<float*>(t_.ptr[l]) + index_;
        for (int k = 0; k < n; ++k) d[k] = in[k];
        break;
      }
      case DType::BF16: {
        uint16_t* d = reinterpret_cast<uint16_t*>(t_.ptr[l]) + index_;
        for (int k = 0; k < n; ++k) d[k] = float_to_bf16(in[k]);
        break;
      }
      case DType::F16: {
        uint16_t* d = reinterpret_cast<uint16_t*>(t_.ptr[l]) + index_;
        for (int k = 0; k < n; ++k) d[k] = float_to_f16(in[k]);
        break;
      }
      case DType::F8E4M3: {
        uint8_t* d = reinterpret_cast<uint8_t*>(t_.ptr[l]) + index_;
        for (int k = 0; k < n; ++k) d[k] = float_to_f8e4m3(in[k]);
        break;
      }
      case DType::Q8S: case DType::Q8U: {  // the tile is one block
        uint8_t* d = reinterpret_cast<uint8_t*>(t_.ptr[l]) + index_;
        const bool is_signed = t_.dtype[l] == DType::Q8S;
        const uint32_t* entries = reinterpret_cast<const uint32_t*>(q8_cell_entries(t_.dtype[l]));
        if (encode_block) {  // one pass with AVX-512 ([Note: CPU gathers])
          *block_max_ptr(l) = encode_block(in, n, entries, is_signed, d);
          break;
        }
        // The block maximum and q8_encode in steps, a loop each, over 32-bit
        // cell entries that settle the code themselves ([Note: settling
        // cells] in dtype.h) and bits read through unions: so the compiler
        // vectorises them (as one loop, or through byte tables, memcpy bit
        // casts or a float max with NaN, it stays scalar). The cell reads
        // are gather32's ([Note: CPU gathers]).
        union Lanes {
          float f[K];
          uint32_t u[K];
        } y, mag;
        // The maximum as the largest |x| bit pattern ([Note: block maxima as bits] in dtype.h).
        for (int k = 0; k < n; ++k) mag.f[k] = in[k];
        uint32_t top = 0;
        for (int k = 0; k < n; ++k) {
          const uint32_t a = mag.u[k] & 0x7fffffffu;
          top = a > top ? a : top;
        }
        const float absmax = q8_block_max(bits_float(top));
        const float inv = q8_inverse(absmax);
        uint32_t index[K], code[K];
        for (int k = 0; k < n; ++k) {
          y.f[k] = in[k] * inv;
          mag.f[k] = q8_magnitude(y.f[k], is_signed);
        }
        for (int k = 0; k < n; ++k) index[k] = q8_cell_index(mag.u[k]);
        gather32(entries, index, code, n);  // [Note: CPU gathers]
        for (int k = 0; k < n; ++k) code[k] = q8_settle_bits(mag.u[k], code[k]);
        for (int k = 0; k < n; ++k) d[k] = q8_with_sign(code[k], y.u[k], is_signed);
        *block_max_ptr(l) = absmax;
        break;
      }
      default:
        break;
    }
  }

  // The maximum of this tile's block (blockwise list l).
  float* block_max_ptr(int l) const {
    return reinterpret_cast<float*>(t_.ptr[t_.block_list[l]]) + index_ / kQuantBlock;
  }

  void load_bits(int l, uint16_t (&out)[K]) const {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(t_.ptr[l]) + index_;
    for (int k = 0; k < count(); ++k) out[k] = s[k];
    if (Padded) for (int k = count(); k < K; ++k) out[k] = 0;
  }

  void store_bits(int l, const uint16_t (&in)[K]) const {
    uint16_t* d = reinterpret_cast<uint16_t*>(t_.ptr[l]) + index_;
    for (int k = 0; k < count(); ++k) d[k] = in[k];
  }

 private:
  const CpuTensor<L>& t_;
  int64_t index_;
  int count_;
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

// Walks one chunk of `tensor` in tiles of K.
template <int K, bool F32Only, class Op, class State>
void cpu_run_tiles(const CpuTensor<Op::kLists>& tensor, const Chunk& ch, const Op& op, State& state) {
  const int64_t end = ch.start + ch.len;
  int64_t i = ch.start;
  for (; i + K <= end; i += K) op.template tile<K>(CpuIO<Op::kLists, K, true, F32Only>(tensor, i, K), state);
  if (i < end) op.template tile<K>(CpuIO<Op::kLists, K, false, F32Only>(tensor, i, int(end - i)), state);
}

// Walks one chunk of `tensor` in padded tiles of K (see CpuIO).
template <int K, class Op, class State>
void cpu_run_padded_tiles(const CpuTensor<Op::kLists>& tensor, const Chunk& ch, const Op& op,
                          State& state) {
  const int64_t end = ch.start + ch.len;
  for (int64_t i = ch.start; i < end; i += K)
    op.template tile<K>(CpuIO<Op::kLists, K, false, false, true>(tensor, i, int(std::min<int64_t>(K, end - i))),
                        state);
}

// Small tensors are separate allocations: the hardware prefetchers, which stop
// at page boundaries, cannot run ahead into the next one. Touching the next
// chunk's first lines while this chunk is computed hides that latency; past
// the first lines the prefetchers keep up on their own.
constexpr int64_t kCpuPrefetchBytes = 8192;

template <int L>
void prefetch_chunk(const TableView& tv, const Chunk& ch) {
  for (int l = 0; l < L; ++l) {
    const int64_t slot = int64_t(l) * tv.num_tensors + ch.tensor;
    const int64_t size = dtype_size(DType(tv.dtypes[slot]));
    if (size == 0) continue;
    const char* base = reinterpret_cast<const char*>(tv.ptrs[slot]) + ch.start * size;
    const int64_t bytes = std::min<int64_t>(int64_t(ch.len) * size, kCpuPrefetchBytes);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(base + b, 1);
  }
}

template <class Op>
void cpu_run_chunks(const TableView& tv, int64_t chunk_begin, int64_t chunk_end, const Op& op) {
  constexpr int K = kCpuTile;
  typename Op::GroupState group_state{};
  int64_t current_group = -1;
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    const Chunk ch = tv.chunks[c];
    if (c + 1 < chunk_end) prefetch_chunk<Op::kLists>(tv, tv.chunks[c + 1]);
    const ChunkCtx ctx{ch.tensor, tv.groups[ch.tensor], c};
    if (int64_t(ctx.group) != current_group) {  // chunks come ordered by group
      group_state = op.group_state(ctx.group);
      current_group = ctx.group;
    }
    const CpuTensor<Op::kLists> tensor(tv, ch.tensor);
    if constexpr (Op::kBlockwise) {
      if (tv.blockwise) {  // chunks start on block boundaries (the table's chunk size)
        auto state = op.template begin<kCpuBlockTile>(ctx, group_state);
        cpu_run_padded_tiles<kCpuBlockTile>(tensor, ch, op, state);
        CpuReducer red;
        op.template finish<kCpuBlockTile>(ctx, state, red);
        continue;
      }
    }
    auto state = op.template begin<K>(ctx, group_state);
    if (tensor.all_f32) cpu_run_tiles<K, true>(tensor, ch, op, state);
    else cpu_run_tiles<K, false>(tensor, ch, op, state);
    CpuReducer red;
    op.template finish<K>(ctx, state, red);
  }
}

// Below this many elements a call stays on the caller's thread.
constexpr int64_t kCpuParallelMin = int64_t(1) << 16;

// Spreads [chunk_begin, chunk_end) over threads; `run(tv, b, e, op)` runs a
// sub-range (cpu_run_chunks, compiled for the CPU's instruction set).
template <class Op, class Run>
void cpu_apply(const TableView& tv, int64_t chunk_begin, int64_t chunk_end, const Op& op,
               const float* skip_if, int threads, Run run) {
  SHARDADAM_CHECK(Op::kBlockwise || !tv.blockwise, "this operation takes no blockwise 8-bit lists");
  if (flag_is_set(skip_if) || chunk_end <= chunk_begin) return;
  int64_t work = 0;
  for (int64_t c = chunk_begin; c < chunk_end && work < kCpuParallelMin; ++c) work += tv.chunks[c].len;
  parallel_for(
      chunk_begin, chunk_end, work < kCpuParallelMin ? 1 : threads,
      [&](int64_t c) { return int64_t(tv.chunks[c].len) + 64; },  // + per-chunk overhead
      [&](int64_t b, int64_t e) { run(tv, b, e, op); });
}

}  // namespace shardadam
