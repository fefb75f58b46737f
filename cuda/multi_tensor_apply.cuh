// The CUDA multi-tensor engine. One launch covers any number of tensors: the
// table (addresses, dtypes, chunks) lives in device memory and each block
// reads its chunk's record, so the kernel arguments stay the same size
// whatever the tensor count. Within a chunk each thread handles tiles of
// kVecElems elements with one vector access per list when the tensor is
// aligned, and element by element otherwise (misaligned views, tails).
// Indices are 64-bit throughout: a tensor may exceed 2^31 elements.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "cuda_check.cuh"
#include "cuda_api.h"
#include "ops.h"

namespace shardadam {

// Threads per block; overridable at build time for tuning experiments
// (CMAKE_CUDA_FLAGS=-DSHARDADAM_CUDA_BLOCK=256).
#ifndef SHARDADAM_CUDA_BLOCK
#define SHARDADAM_CUDA_BLOCK 512
#endif
constexpr int kBlock = SHARDADAM_CUDA_BLOCK;
// Elements per thread per step: a multiple of kVecElems (one vector access
// per list each). Measured on an H200 (benchmarks/RESULTS.md): tiles of 8,
// blocks of 256 or 1024, L2 prefetch of the next tile, streaming cache hints,
// smaller chunks and a persistent grid-stride walk were all no faster.
constexpr int kTile = kVecElems;
// [Note: FP8 tiles] Tables with FP8 lists take tiles of 8 elements per
// thread: each list's loads of a tile are issued together (two vector accesses
// each), so a thread keeps twice the bytes in flight, and the per-tile costs
// (indices, bounds, the conversions' mend tests) are spread over twice the
// elements. Their passes move few bytes per element (14 and 8), so at tiles
// of 4 neither kept the memory busy. On an H200 (2^30 elements, fp32
// parameters): 6.91 ms at 4, 5.90-6.33 ms at 8, 13.2 ms at 16, which spills
// (benchmarks/RESULTS.md, "Storage kinds"). At 8 the kernels spill 40 bytes
// at 64 registers ([Note: full tiles first]) and are still the fastest.
// Tables whose lists are all 16-bit (8 bytes per element or fewer: bf16
// parameters with bf16 or scaled fp16 states) are short of bytes in flight
// the same way and take the same tiles, without spills: on an H200 (2^30
// elements, 200 tensors) bf16 states 4.05 -> 3.65 ms (0.87 -> 0.96 of copy),
// scaled fp16 states 6.39 -> 5.73 ms (RESULTS.md, "Mixed state dtypes").
// Overridable for tuning:
// -DSHARDADAM_F8_TILE=4.
#ifndef SHARDADAM_F8_TILE
#define SHARDADAM_F8_TILE 8
#endif
constexpr int kF8Tile = SHARDADAM_F8_TILE;
static_assert(kF8Tile % kVecElems == 0, "an FP8 tile is whole vector accesses");
// Tables with blockwise 8-bit lists: a warp's 32 threads take one block of
// kQuantBlock elements, so a block's maximum is one warp reduction.
constexpr int kBlockTile = kQuantBlock / 32;
static_assert(kBlockTile % kVecElems == 0, "a block tile is whole vector accesses");
// At least 1024 threads per multiprocessor: caps registers at 64 per thread.
constexpr int kMinBlocks = 1024 / kBlock > 0 ? 1024 / kBlock : 1;
// Blockwise kernels hold twice the elements per thread and the map lookups,
// about 120 instructions per element: they are bound by latency and issue, not
// by memory, so they need the warps of two blocks per multiprocessor, at 64
// registers (no spills: [Note: full tiles first]); one block at up to 128
// registers left no warp eligible in 41% of cycles. On an H200 (2^30
// elements, fp32 parameters, 8-bit states): 5.55 ms at two blocks, 6.75 ms at
// one, 5.53 ms at three blocks of 256 threads (benchmarks/RESULTS.md).
// Overridable for tuning: -DSHARDADAM_BLOCKWISE_MIN_BLOCKS=1. The general
// (TableDtypes) blockwise kernel, which keeps every list's dtype in registers,
// would spill 656 bytes at two blocks and stays at one.
#ifndef SHARDADAM_BLOCKWISE_MIN_BLOCKS
#define SHARDADAM_BLOCKWISE_MIN_BLOCKS 2
#endif
constexpr int kMinBlocksBlockwise = SHARDADAM_BLOCKWISE_MIN_BLOCKS;
template <class Dtypes, bool kBlocks>
constexpr int kMinBlocksFor = !kBlocks ? kMinBlocks : (Dtypes::kFixed ? kMinBlocksBlockwise : 1);
constexpr int64_t kMaxGrid = 0x7fffffff;

template <class T, int K>
struct alignas(sizeof(T) * K) Pack {
  T v[K];
};

// Whether any code's low 7 bits (its magnitude) are at least `floor` (0x7e
// or 0x7f): four codes per 32-bit word, adding 0x80 - floor to each byte's
// low 7 bits carries into its bit 7 exactly then, and never into the next
// byte ([Note: hardware FP8 conversions]).
template <int K>
__device__ bool any_low7_at_least(const uint8_t (&c)[K], uint32_t floor) {
  static_assert(K % 4 == 0, "codes are tested four to a word");
  const uint32_t add = (0x80u - floor) * 0x01010101u;
  uint32_t hits = 0;
#pragma unroll
  for (int k = 0; k < K; k += 4) {
    const uint32_t w = uint32_t(c[k]) | (uint32_t(c[k + 1]) << 8) | (uint32_t(c[k + 2]) << 16) |
                       (uint32_t(c[k + 3]) << 24);
    hits |= ((w & 0x7f7f7f7fu) + add) & 0x80808080u;
  }
  return hits != 0;
}

// The largest of a warp's values, in every lane: one reduction instruction
// from sm_80 on, five shuffle rounds before (the same result: integer maxima
// are exact).
__device__ inline uint32_t warp_max(uint32_t v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
#endif
}

// [Note: hardware FP8 conversions] From sm_89 on, one instruction converts
// a pair of E4M3 codes to two halves (exactly: every E4M3 value is a half) and
// a pair of floats to E4M3 codes (rounding to nearest even, as dtype.h's
// software conversion). Where they differ from dtype.h the results are mended,
// so both give the same bits (the CPU engine's): dtype.h decodes a NaN code to
// the float NaN 0x7fc00000 with the code's sign, and encodes magnitudes of
// 464 and up and non-finite values as NaN with the float's sign, where the
// hardware saturates to 448. Every code to mend has magnitude bits 0x7e or
// 0x7f, so a word test of four codes (any_low7_at_least) decides whether a
// tile needs the element-wise mends at all. The software conversions take
// several integer and float steps per element each way, in kernels that were
// bound by issue (benchmarks/RESULTS.md, "Storage kinds").
template <int K>
__device__ void decode_e4m3(const uint8_t (&b)[K], float (&out)[K]) {
  static_assert(K % 2 == 0, "E4M3 codes convert in pairs");
#if __CUDA_ARCH__ >= 890
#pragma unroll
  for (int k = 0; k < K; k += 2) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(b[k] | (b[k + 1] << 8)), __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    out[k] = f.x;
    out[k + 1] = f.y;
  }
  if (any_low7_at_least(b, 0x7f)) {  // a NaN code
#pragma unroll
    for (int k = 0; k < K; ++k)
      if ((b[k] & 0x7fu) == 0x7fu) out[k] = f8e4m3_nan_float(b[k]);
  }
#else
#pragma unroll
  for (int k = 0; k < K; ++k) out[k] = f8e4m3_to_float(b[k]);
#endif
}

template <int K>
__device__ void encode_e4m3(const float (&in)[K], uint8_t (&out)[K]) {
  static_assert(K % 2 == 0, "E4M3 codes convert in pairs");
#if __CUDA_ARCH__ >= 890
#pragma unroll
  for (int k = 0; k < K; k += 2) {
    const __nv_fp8x2_storage_t pair =
        __nv_cvt_float2_to_fp8x2(make_float2(in[k], in[k + 1]), __NV_SATFINITE, __NV_E4M3);
    out[k] = uint8_t(pair & 0xffu);
    out[k + 1] = uint8_t(pair >> 8);
  }
  // Every value to mend came out as 448 (saturated) or NaN: magnitude codes 0x7e, 0x7f.
  if (any_low7_at_least(out, 0x7e)) {
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (!(fabsf(in[k]) < 464.0f)) out[k] = f8e4m3_nan_code(in[k]);
  }
#else
#pragma unroll
  for (int k = 0; k < K; ++k) out[k] = float_to_f8e4m3(in[k]);
#endif
}

// Where a kernel takes its dtypes from. TableDtypes reads them from the table
// (any mix, a switch per access). FixedDtypes<...> fixes one dtype per list at
// compile time: the switches fold away and each tile's loads are issued back
// to back. Through the switches the compiler funnelled every list's load into
// the same registers, one memory round trip per list: 78% of copy bandwidth
// on an H200 where the fixed kernel runs near copy speed (benchmarks/RESULTS.md).
struct TableDtypes {
  static constexpr bool kFixed = false;
  __device__ static constexpr DType at(int) { return DType::None; }
};
template <DType... Ds>
struct FixedDtypes {
  static constexpr bool kFixed = true;
  static constexpr int kCount = sizeof...(Ds);
  // Lists past the given ones are absent (a signature may leave out the trailing block lists).
  __host__ __device__ static constexpr DType at(int l) {
    constexpr DType d[] = {Ds...};
    return l < kCount ? d[l] : DType::None;
  }
  static constexpr bool has(DType a, DType b = DType::None) {
    for (int l = 0; l < kCount; ++l)
      if (at(l) == a || (b != DType::None && at(l) == b)) return true;
    return false;
  }
  static constexpr bool has_blockwise() { return has(DType::Q8S, DType::Q8U); }
  // Bytes of one element over every list (each read once).
  static constexpr int64_t element_bytes() {
    int64_t bytes = 0;
    for (int l = 0; l < kCount; ++l) bytes += at(l) == DType::None ? 0 : dtype_size(at(l));
    return bytes;
  }
  // [Note: FP8 tiles]: FP8 lists, or at most 8 bytes per element, take the longer tile.
  static constexpr int tile() {
    return has_blockwise() ? kBlockTile : (has(DType::F8E4M3) || element_bytes() <= 8 ? kF8Tile : kTile);
  }
};

// Which FixedDtypes an op gets kernels for: a list of them in OpFastDtypes<Op>
// (specialised next to the op's launch). Tables matching none of them run the
// TableDtypes kernel.
template <class... Sigs>
struct DtypeList {};
template <class Op>
struct OpFastDtypes {
  using type = DtypeList<>;
};

// One tensor's addresses (and dtypes, when not fixed), read once per block.
template <int L, class Dtypes>
struct TensorRefs {
  __device__ TensorRefs(const TableView& tv, uint32_t tensor, const Q8Maps* maps) : q8(maps) {
#pragma unroll
    for (int l = 0; l < L; ++l) {
      ptr[l] = reinterpret_cast<char*>(tv.ptrs[int64_t(l) * tv.num_tensors + tensor]);
      // Read from the table, not ptr[block_list[l]]: a runtime index would put ptr in local memory.
      // Unused (no blockwise list l), the load is dropped.
      const int b = tv.block_list[l];
      blocks[l] = maps && b >= 0 ? reinterpret_cast<float*>(tv.ptrs[int64_t(b) * tv.num_tensors + tensor]) : nullptr;
      if constexpr (!Dtypes::kFixed) dtype[l] = DType(tv.dtypes[int64_t(l) * tv.num_tensors + tensor]);
    }
  }
  // A hint to bring the elements at `index` of the given lists (list_bit
  // mask) into L2; the caller keeps index within the tensor.
  __device__ void prefetch_l2(uint32_t lists, int64_t index) const {
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const DType d = dtype_of(l);
      if (!(lists & list_bit(l)) || d == DType::None) continue;
      asm volatile("prefetch.L2 [%0];" ::"l"(ptr[l] + index * dtype_size(d)));
    }
  }
  __device__ DType dtype_of(int l) const {
    if constexpr (Dtypes::kFixed) {
      return Dtypes::at(l);
    } else {
      return dtype[l];
    }
  }
  char* ptr[L];
  DType dtype[Dtypes::kFixed ? 1 : L];
  float* blocks[L];  // the block maxima of blockwise list l
  const Q8Maps* q8;  // in shared memory, in blockwise kernels
};

// [Note: global accesses] The table's addresses reach the kernel as plain
// pointers, so nvcc emitted generic loads and stores (LD.E, ST.E), which it
// must also assume may alias shared memory: the blockwise kernels' map reads
// then could not move across a tile's stores. Every address the table holds
// is device-global memory, so the accesses of full tiles (an in-range element
// of a present list) tell the compiler so, and become LDG and STG.

// One tile of one tensor. kFull: K elements, every list aligned for vector
// access (the steady state, with no per-access branch); otherwise element by
// element with count() real elements (misaligned views, tails).
template <int L, int K, class Dtypes, bool kFull>
class CudaIO {
 public:
  __device__ CudaIO(const TensorRefs<L, Dtypes>& refs, int64_t index, int count)
      : refs_(refs), index_(index), count_(kFull ? K : count) {}
  __device__ DType dtype(int l) const { return refs_.dtype_of(l); }
  __device__ int count() const { return count_; }
  __device__ constexpr int lanes() const { return K; }
  __device__ int64_t index() const { return index_; }  // of lane 0 in its tensor

  __device__ void load(int l, float (&out)[K]) const {
    switch (dtype(l)) {
      case DType::F32: {
        float r[K];
        load_raw(reinterpret_cast<const float*>(refs_.ptr[l]) + index_, r);
#pragma unroll
        for (int k = 0; k < K; ++k) out[k] = r[k];
        break;
      }
      case DType::BF16: {
        uint16_t r[K];
        load_raw(reinterpret_cast<const uint16_t*>(refs_.ptr[l]) + index_, r);
#pragma unroll
        for (int k = 0; k < K; ++k) out[k] = bf16_to_float(r[k]);
        break;
      }
      case DType::F16: {
        uint16_t r[K];
        load_raw(reinterpret_cast<const uint16_t*>(refs_.ptr[l]) + index_, r);
#pragma unroll
        for (int k = 0; k < K; ++k) out[k] = f16_to_float(r[k]);
        break;
      }
      case DType::F8E4M3: {
        uint8_t r[K];
        load_raw(reinterpret_cast<const uint8_t*>(refs_.ptr[l]) + index_, r);
        decode_e4m3(r, out);
        break;
      }
      case DType::Q8S: case DType::Q8U: {  // only in blockwise kernels (q8 set)
        uint8_t r[K];
        load_raw(reinterpret_cast<const uint8_t*>(refs_.ptr[l]) + index_, r);
        const float* decode = q8_map_of(*refs_.q8, dtype(l)).decode;
        const float absmax = *block_max_ptr(l);  // the same address for the warp: one broadcast
#pragma unroll
        for (int k = 0; k < K; ++k) out[k] = decode[r[k]] * absmax;
        break;
      }
      default:
#pragma unroll
        for (int k = 0; k < K; ++k) out[k] = 0.0f;
    }
  }

  __device__ void store(int l, const float (&in)[K]) const {
    switch (dtype(l)) {
      case DType::F32: {
        float r[K];
#pragma unroll
        for (int k = 0; k < K; ++k) r[k] = in[k];
        store_raw(reinterpret_cast<float*>(refs_.ptr[l]) + index_, r);
        break;
      }
      case DType::BF16: {
        uint16_t r[K];
#pragma unroll
        for (int k = 0; k < K; ++k) r[k] = float_to_bf16(in[k]);
        store_raw(reinterpret_cast<uint16_t*>(refs_.ptr[l]) + index_, r);
        break;
      }
      case DType::F16: {
        uint16_t r[K];
#pragma unroll
        for (int k = 0; k < K; ++k) r[k] = float_to_f16(in[k]);
        store_raw(reinterpret_cast<uint16_t*>(refs_.ptr[l]) + index_, r);
        break;
      }
      case DType::F8E4M3: {
        uint8_t r[K];
        encode_e4m3(in, r);
        store_raw(reinterpret_cast<uint8_t*>(refs_.ptr[l]) + index_, r);
        break;
      }
      case DType::Q8S: case DType::Q8U: {  // the warp is one block; every lane is here
        // The largest |x| bit pattern, as the CPU engine's ([Note: block maxima as bits] in dtype.h):
        // integer maxima, one warp reduction.
        uint32_t top = 0;
#pragma unroll
        for (int k = 0; k < K; ++k) top = max(top, k < count_ ? float_bits(in[k]) & 0x7fffffffu : 0u);
        const float absmax = q8_block_max(bits_float(warp_max(top)));
        const float inv = q8_inverse(absmax);
        const Q8Map& map = q8_map_of(*refs_.q8, dtype(l));
        const bool is_signed = dtype(l) == DType::Q8S;
        uint8_t r[K];
#pragma unroll
        for (int k = 0; k < K; ++k) r[k] = q8_encode(in[k] * inv, map, is_signed);
        store_raw(reinterpret_cast<uint8_t*>(refs_.ptr[l]) + index_, r);
        if (index_ % kQuantBlock == 0) *block_max_ptr(l) = absmax;  // lane 0: always a real element
        break;
      }
      default:
        break;
    }
  }

  __device__ float* block_max_ptr(int l) const {
    float* p = refs_.blocks[l] + index_ / kQuantBlock;
    __builtin_assume(__isGlobal(p));  // [Note: global accesses]
    return p;
  }

  __device__ void load_bits(int l, uint16_t (&out)[K]) const {
    load_raw(reinterpret_cast<const uint16_t*>(refs_.ptr[l]) + index_, out);
  }
  __device__ void store_bits(int l, const uint16_t (&in)[K]) const {
    store_raw(reinterpret_cast<uint16_t*>(refs_.ptr[l]) + index_, in);
  }

 private:
  template <class T>
  __device__ void load_raw(const T* src, T (&r)[K]) const {
    if constexpr (kFull) {
      __builtin_assume(__isGlobal(src));  // [Note: global accesses]
#pragma unroll
      for (int j = 0; j < K; j += kVecElems) {
        const Pack<T, kVecElems> p = *reinterpret_cast<const Pack<T, kVecElems>*>(src + j);
#pragma unroll
        for (int k = 0; k < kVecElems; ++k) r[j + k] = p.v[k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) r[k] = k < count_ ? src[k] : T(0);
    }
  }
  template <class T>
  __device__ void store_raw(T* dst, const T (&r)[K]) const {
    if constexpr (kFull) {
      __builtin_assume(__isGlobal(dst));  // [Note: global accesses]
#pragma unroll
      for (int j = 0; j < K; j += kVecElems) {
        Pack<T, kVecElems> p;
#pragma unroll
        for (int k = 0; k < kVecElems; ++k) p.v[k] = r[j + k];
        *reinterpret_cast<Pack<T, kVecElems>*>(dst + j) = p;
      }
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (k < count_) dst[k] = r[k];
    }
  }

  const TensorRefs<L, Dtypes>& refs_;
  int64_t index_;
  int count_;
};

// Block-wide reductions in a fixed order (deterministic), warp shuffles then
// one shared-memory step. Every thread of the block calls each method.
class CudaReducer {
 public:
  __device__ void max_to(float* addr, float v) {
    // Identity 0: the values reduced are absolute values.
    const float m = reduce(v, 0.0f, [](float a, float b) { return nan_max(a, b); });
    // Non-negative floats order like their bit patterns (NaN above infinity).
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(addr), __float_as_uint(m));
  }
  __device__ void sum_to(float* addr, float v) {
    const float s = reduce(v, 0.0f, [](float a, float b) { return a + b; });
    if (threadIdx.x == 0) *addr = s;
  }
  __device__ void flag_if(float* addr, bool v) {
    if (__syncthreads_or(v) && threadIdx.x == 0) *addr = 1.0f;
  }

 private:
  template <class F>
  __device__ float reduce(float v, float identity, F f) {
    __shared__ float partial[kBlock / 32];
    for (int o = 16; o > 0; o /= 2) v = f(v, __shfl_down_sync(0xffffffffu, v, o));
    __syncthreads();  // partial may still be read by a previous reduction
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
      v = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : identity;
      for (int o = 16; o > 0; o /= 2) v = f(v, __shfl_down_sync(0xffffffffu, v, o));
    }
    return v;  // valid in thread 0
  }
};

// Which elements a block handles: the C chunks of a tensor are C blocks that
// deal the tensor out in sweeps of kBlock * K elements, block k taking sweeps
// k, k + C, k + 2C, ... Blocks start in index order, so the resident blocks of
// a tensor walk it side by side as one dense front. Giving each block its own
// contiguous chunk instead keeps ~1,800 separate streams open on an H200 and
// held Adam at 78% of copy bandwidth (benchmarks/RESULTS.md). Every launch
// covers whole tensors (group ranges are tensor-aligned), so each element is
// still handled exactly once; per-chunk partial results stay per-tensor exact.
//
// Blockwise kernels (kBlocks, K == kBlockTile) walk warp by warp: a warp goes on while
// its block has elements, lanes past the tensor's end taking empty tiles, so
// that every lane joins each block reduction. They read the dynamic maps
// from shared memory.
//
// [Note: full tiles first] A thread first walks its full tiles, in a loop of
// their own, then the rest (the tensor's last unit, or every tile of a
// misaligned tensor, without the next-tile prefetch). Only a thread's last
// tile can be partial, yet in one loop holding both paths the element-wise
// path's registers weighed on the steady state: at the 64 registers of two
// blocks per multiprocessor, ptxas kept the blockwise kernels' loop index,
// alignment flag and a list address in local memory (20-64 bytes of spills,
// reloaded at every tile). Split, no blockwise kernel spills and the FP8
// kernels spill 40 bytes instead of 52-64 (ptxas -v, sm_90). On an H200 (2^30
// elements, fp32 parameters): 8-bit states 4.82-4.84 -> 4.59-4.61 ms (0.84 ->
// 0.88 of copy), FP8 states 5.89-5.91 -> 5.68 ms, fp32 and bf16 unchanged
// (benchmarks/RESULTS.md, "Storage kinds").
//
// [Note: next-tile prefetch] Blockwise kernels ask L2 for the thread's next
// tile (one sweep on) of each list the op reads before they work on the
// current one. Their tiles are long chains of dependent work (loads, map
// lookups, the block reduction, the encode) with few warps eligible, so a
// tile's loads waited on DRAM; with the next tile in L2 they wait on L2. On
// an H200 (2^30 elements, fp32 parameters, 8-bit states): 4.96-4.98 ms
// without, 4.81-4.87 with; two sweeps ahead 5.31-5.39; the codes alone
// 4.88-4.90; into L1 instead 4.82-4.86 (benchmarks/RESULTS.md, "Storage
// kinds"). The other kernels are bound by memory and gained nothing from it.
template <class Op, class Dtypes, int K, bool kBlocks>
__global__ void __launch_bounds__(kBlock, kMinBlocksFor<Dtypes, kBlocks>)
    multi_tensor_kernel(const TableView tv, const int64_t chunk_begin, const __grid_constant__ Op op,
                        const float* skip_if) {
  constexpr int64_t kSweep = int64_t(kBlock) * K;
  if (flag_is_set(skip_if)) return;  // the same answer for every block
  __shared__ std::conditional_t<kBlocks, Q8Maps, char> shared_maps;
  const Q8Maps* maps = nullptr;
  if constexpr (kBlocks) {
    const uint4* src = reinterpret_cast<const uint4*>(tv.q8);
    uint4* dst = reinterpret_cast<uint4*>(&shared_maps);
    maps = &shared_maps;
    for (int w = threadIdx.x; w < int(sizeof(Q8Maps) / sizeof(uint4)); w += kBlock) dst[w] = src[w];
    __syncthreads();
  }
  const int64_t c = chunk_begin + blockIdx.x;
  const uint32_t tensor = tv.chunks[c].tensor;
  const int64_t first_chunk = tv.tensor_chunks[tensor];
  const int64_t sweep_stride = (tv.tensor_chunks[tensor + 1] - first_chunk) * kSweep;
  const int64_t n = tv.numels[tensor];
  const bool vector_ok = tv.aligned[tensor] != 0;
  const ChunkCtx ctx{tensor, tv.groups[tensor], c};
  const TensorRefs<Op::kLists, Dtypes> refs(tv, tensor, maps);
  auto state = op.template begin<K>(ctx, op.group_state(ctx.group));
  const int64_t lead = kBlocks ? int64_t(threadIdx.x & 31) * K : 0;  // this lane's offset in its warp's block
  // [Note: full tiles first] A tile is full when its whole unit lies in the tensor (the warp's
  // block in blockwise kernels, so that a warp takes one path; the thread's tile otherwise).
  constexpr int64_t kUnit = kBlocks ? kQuantBlock : K;
  int64_t i = (c - first_chunk) * kSweep + int64_t(threadIdx.x) * K;
  if (vector_ok) {
    for (; i - lead + kUnit <= n; i += sweep_stride) {
      if constexpr (kBlocks) {
        if (i + sweep_stride + K <= n) refs.prefetch_l2(Op::kReadLists, i + sweep_stride);
      }
      op.template tile<K>(CudaIO<Op::kLists, K, Dtypes, true>(refs, i, K), state);
    }
  }
  for (; i - lead < n; i += sweep_stride) {  // the tensor's last unit; every tile when misaligned
    const int64_t left = n - i;
    op.template tile<K>(CudaIO<Op::kLists, K, Dtypes, false>(refs, i, int(left < 0 ? 0 : (left < K ? left : K))),
                        state);
  }
  CudaReducer red;
  op.template finish<K>(ctx, state, red);
}

// Small kernels for the steps around a multi-tensor pass (cuda/engine.cu).
void launch_commit_scales(const UpdateArgs& a, int64_t num_tensors, const float* skip_if,
                          cudaStream_t stream);
void launch_finalize_norm(const TableView& tv, const float* partials, float* per_tensor,
                          float* total, cudaStream_t stream);

struct CudaEngine {
  const TensorTable& table;
  TableView tv;
  cudaStream_t stream;

  template <class Op>
  void apply(int64_t chunk_begin, int64_t chunk_end, const Op& op, const float* skip_if) const {
    launch_first_match(typename OpFastDtypes<Op>::type{}, chunk_begin, chunk_end, op, skip_if);
  }
  // The kernel for the first FixedDtypes the whole table matches, else the
  // TableDtypes one.
  template <class Op, class Sig, class... Rest>
  void launch_first_match(DtypeList<Sig, Rest...>, int64_t chunk_begin, int64_t chunk_end, const Op& op,
                          const float* skip_if) const {
    bool match = true;
    for (int l = 0; l < Op::kLists; ++l) match = match && table.list_dtype_is(l, Sig::at(l));
    if (match) {
      launch<Op, Sig>(chunk_begin, chunk_end, op, skip_if);
    } else {
      launch_first_match(DtypeList<Rest...>{}, chunk_begin, chunk_end, op, skip_if);
    }
  }
  template <class Op>
  void launch_first_match(DtypeList<>, int64_t chunk_begin, int64_t chunk_end, const Op& op,
                          const float* skip_if) const {
    launch<Op, TableDtypes>(chunk_begin, chunk_end, op, skip_if);
  }
  // Blockwise tables take the blockwise kernel: of the general one, or of a
  // signature with blockwise lists (which no other table matches).
  template <class Op, class Dtypes>
  void launch(int64_t chunk_begin, int64_t chunk_end, const Op& op, const float* skip_if) const {
    SHARDADAM_CHECK(Op::kBlockwise || !table.blockwise(), "this operation takes no blockwise 8-bit lists");
    if constexpr (Dtypes::kFixed) {
      launch_tiles<Op, Dtypes, Dtypes::tile(), Dtypes::has_blockwise()>(chunk_begin, chunk_end, op, skip_if);
    } else if constexpr (Op::kBlockwise) {
      if (table.blockwise()) launch_tiles<Op, Dtypes, kBlockTile, true>(chunk_begin, chunk_end, op, skip_if);
      else launch_tiles<Op, Dtypes, kTile, false>(chunk_begin, chunk_end, op, skip_if);
    } else {
      launch_tiles<Op, Dtypes, kTile, false>(chunk_begin, chunk_end, op, skip_if);
    }
  }
  template <class Op, class Dtypes, int K, bool kBlocks>
  void launch_tiles(int64_t chunk_begin, int64_t chunk_end, const Op& op, const float* skip_if) const {
    for (int64_t c = chunk_begin; c < chunk_end; c += kMaxGrid) {
      const int64_t n = chunk_end - c < kMaxGrid ? chunk_end - c : kMaxGrid;
      multi_tensor_kernel<Op, Dtypes, K, kBlocks><<<unsigned(n), kBlock, 0, stream>>>(tv, c, op, skip_if);
      cuda_check(cudaGetLastError(), "multi_tensor_kernel launch");
    }
  }

  void zero(float* p, int64_t n) const {
    cuda_check(cudaMemsetAsync(p, 0, size_t(n) * sizeof(float), stream), "cudaMemsetAsync");
  }
  void commit_scales(const UpdateArgs& a, int64_t num_tensors, const float* skip_if) const {
    launch_commit_scales(a, num_tensors, skip_if, stream);
  }
  void finalize_norm(const float* partials, float* per_tensor, float* total) const {
    launch_finalize_norm(tv, partials, per_tensor, total, stream);
  }
};

inline CudaEngine make_engine(const TensorTable& t, const CudaTarget& where) {
  return CudaEngine{t, t.view(reinterpret_cast<const void*>(where.blob)),
                    reinterpret_cast<cudaStream_t>(where.stream)};
}

}  // namespace shardadam
