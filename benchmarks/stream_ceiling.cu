// What bandwidth can any kernel reach on the optimizer's access pattern?
// Adam in fp32 reads 4 streams and writes 3 (28 B per element). This program
// times streaming kernels with no arithmetic to speak of, for 1 read + 1 write
// (a copy) and 4 reads + 3 writes, with plain 16-byte loads and with Hopper's
// bulk asynchronous copies (TMA) staging 16 KB per stream through shared
// memory. The ratio 4R3W / copy is the ceiling for a fused Adam kernel.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/stream_ceiling.cu -o /tmp/stream_ceiling && /tmp/stream_ceiling
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e = (x);                                                              \
    if (e != cudaSuccess) {                                                           \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      return 1;                                                                       \
    }                                                                                 \
  } while (0)

__global__ void copy_plain(const float4* __restrict__ a, float4* __restrict__ b, size_t n4) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n4; i += size_t(gridDim.x) * blockDim.x)
    b[i] = a[i];
}

__device__ __forceinline__ float4 axpy(float4 x, float s, float4 y) {
  return make_float4(x.x * s + y.x, x.y * s + y.y, x.z * s + y.z, x.w * s + y.w);
}

// p, m, v updated in place from g: the byte pattern of fp32 Adam.
__global__ void adam_pattern_plain(float4* __restrict__ p, const float4* __restrict__ g, float4* __restrict__ m,
                                   float4* __restrict__ v, size_t n4) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n4; i += size_t(gridDim.x) * blockDim.x) {
    const float4 gi = g[i], mi = m[i], vi = v[i], pi = p[i];
    m[i] = axpy(mi, 0.9f, gi);
    v[i] = axpy(vi, 0.999f, gi);
    p[i] = axpy(gi, -1e-3f, pi);
  }
}

// The same pattern in the order of a block-per-chunk engine: block b owns
// elements [b * 65536, (b + 1) * 65536), 512 threads, 16 bytes per access.
__global__ void __launch_bounds__(512) adam_pattern_chunked(float4* __restrict__ p, const float4* __restrict__ g,
                                                          float4* __restrict__ m, float4* __restrict__ v,
                                                          size_t n4) {
  const size_t begin = blockIdx.x * size_t(65536 / 4), end = min(begin + 65536 / 4, n4);
  for (size_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float4 gi = g[i], mi = m[i], vi = v[i], pi = p[i];
    m[i] = axpy(mi, 0.9f, gi);
    v[i] = axpy(vi, 0.999f, gi);
    p[i] = axpy(gi, -1e-3f, pi);
  }
}

// The chunked kernel again, but each thread runs kStages tiles ahead: it
// copies its next tiles of the four read streams into its own shared-memory
// slots with cp.async (no registers held while the bytes are in flight), so
// the bytes in flight no longer depend on how many threads are resident.
// Launched with kStagedSmem bytes: 2 blocks (1,024 threads) per SM, as the
// 64-register Adam engine gets. `staged` = false runs the plain loop at the
// same occupancy for comparison.
constexpr int kStages = 3;
constexpr int kStagedSmem = kStages * 4 * 16 * 512;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))),
               "l"(gmem)
               : "memory");
}

__global__ void __launch_bounds__(512) adam_pattern_chunked_staged(float4* __restrict__ p, const float4* __restrict__ g,
                                                                 float4* __restrict__ m, float4* __restrict__ v,
                                                                 size_t n4, bool staged) {
  extern __shared__ float4 slots[];  // [stage][stream][thread]
  const size_t begin = blockIdx.x * size_t(65536 / 4), end = min(begin + 65536 / 4, n4);
  const float4* src[4] = {p, g, m, v};
  if (!staged) {
    for (size_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float4 gi = g[i], mi = m[i], vi = v[i], pi = p[i];
      m[i] = axpy(mi, 0.9f, gi);
      v[i] = axpy(vi, 0.999f, gi);
      p[i] = axpy(gi, -1e-3f, pi);
    }
    return;
  }
  auto slot = [&](int stage, int l) -> float4& { return slots[(stage * 4 + l) * 512 + threadIdx.x]; };
  auto issue = [&](size_t i, int stage) {
    if (i < end)
      for (int l = 0; l < 4; ++l) cp_async16(&slot(stage, l), src[l] + i);
    asm volatile("cp.async.commit_group;" ::: "memory");  // empty groups keep the count
  };
  const size_t stride = blockDim.x;
  for (int s = 0; s < kStages - 1; ++s) issue(begin + threadIdx.x + s * stride, s);
  int stage = 0;
  for (size_t i = begin + threadIdx.x; i < end; i += stride) {
    issue(i + (kStages - 1) * stride, (stage + kStages - 1) % kStages);
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1) : "memory");
    const float4 pi = slot(stage, 0), gi = slot(stage, 1), mi = slot(stage, 2), vi = slot(stage, 3);
    m[i] = axpy(mi, 0.9f, gi);
    v[i] = axpy(vi, 0.999f, gi);
    p[i] = axpy(gi, -1e-3f, pi);
    stage = (stage + 1) % kStages;
  }
}

// Distinct finite values in [0.5, 1): constant data can time differently.
__global__ void fill_hash(float* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    x[i] = __uint_as_float(0x3f000000u | (h >> 9));
  }
}

constexpr int kStage = 4096;  // floats per stream per stage: 16 KB

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__global__ void __launch_bounds__(256) adam_pattern_tma(float* p, const float* g, float* m, float* v, size_t n) {
  extern __shared__ __align__(128) float smem[];  // 4 streams x kStage
  __shared__ __align__(8) unsigned long long bar;
  float* sp = smem;
  float* sg = smem + kStage;
  float* sm = smem + 2 * kStage;
  float* sv = smem + 3 * kStage;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bar)));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  unsigned phase = 0;
  const size_t stages = n / kStage;
  for (size_t s = blockIdx.x; s < stages; s += gridDim.x) {
    const size_t off = s * kStage;
    if (threadIdx.x == 0) {
      const unsigned bytes = kStage * 4;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&bar)), "r"(4 * bytes));
      const float* src[4] = {p + off, g + off, m + off, v + off};
      float* dst[4] = {sp, sg, sm, sv};
      for (int l = 0; l < 4; ++l)
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                smem_addr(dst[l])),
            "l"(src[l]), "r"(bytes), "r"(smem_addr(&bar))
            : "memory");
    }
    // Wait for the stage's bytes.
    unsigned done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred P; mbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2; selp.u32 %0, 1, 0, P; }"
          : "=r"(done)
          : "r"(smem_addr(&bar)), "r"(phase)
          : "memory");
    }
    phase ^= 1;
    for (int i = threadIdx.x; i < kStage / 4; i += blockDim.x) {
      float4* p4 = reinterpret_cast<float4*>(sp);
      const float4* g4 = reinterpret_cast<const float4*>(sg);
      float4* m4 = reinterpret_cast<float4*>(sm);
      float4* v4 = reinterpret_cast<float4*>(sv);
      const float4 gi = g4[i];
      m4[i] = axpy(m4[i], 0.9f, gi);
      v4[i] = axpy(v4[i], 0.999f, gi);
      p4[i] = axpy(gi, -1e-3f, p4[i]);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      const unsigned bytes = kStage * 4;
      float* dstg[3] = {p + off, m + off, v + off};
      float* srcs[3] = {sp, sm, sv};
      for (int l = 0; l < 3; ++l)
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dstg[l]),
                     "r"(smem_addr(srcs[l])), "r"(bytes)
                     : "memory");
      asm volatile("cp.async.bulk.commit_group;");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
    __syncthreads();
  }
}

template <class F>
float time_ms(F f) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> t;
  for (int i = 0; i < 15; ++i) {
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  const int log2n = argc > 1 ? std::atoi(argv[1]) : 28;
  const size_t n = size_t(1) << log2n;  // floats per stream (28: 1 GiB)
  float *p, *g, *m, *v;
  CHECK(cudaMalloc(&p, n * 4));
  CHECK(cudaMalloc(&g, n * 4));
  CHECK(cudaMalloc(&m, n * 4));
  CHECK(cudaMalloc(&v, n * 4));
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  unsigned seed = 1;
  for (float* x : {p, g, m, v}) fill_hash<<<sms * 8, 256>>>(x, n, seed++);
  const size_t n4 = n / 4;
  const float t_copy = time_ms([&] { copy_plain<<<sms * 8, 256>>>((const float4*)g, (float4*)p, n4); });
  const float t_plain = time_ms([&] { adam_pattern_plain<<<sms * 8, 256>>>((float4*)p, (const float4*)g, (float4*)m, (float4*)v, n4); });
  const float t_chunked = time_ms([&] {
    adam_pattern_chunked<<<unsigned((n + 65535) / 65536), 512>>>((float4*)p, (const float4*)g, (float4*)m,
                                                                 (float4*)v, n4);
  });
  CHECK(cudaFuncSetAttribute(adam_pattern_chunked_staged, cudaFuncAttributeMaxDynamicSharedMemorySize, kStagedSmem));
  float t_half[2];
  for (int staged = 0; staged < 2; ++staged)
    t_half[staged] = time_ms([&] {
      adam_pattern_chunked_staged<<<unsigned((n + 65535) / 65536), 512, kStagedSmem>>>(
          (float4*)p, (const float4*)g, (float4*)m, (float4*)v, n4, staged);
    });
  CHECK(cudaGetLastError());
  const int smem = 4 * kStage * 4;
  CHECK(cudaFuncSetAttribute(adam_pattern_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const float t_tma = time_ms([&] { adam_pattern_tma<<<sms * 3, 256, smem>>>(p, g, m, v, n); });
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  // bytes / ms / 1e9 = TB/s
  const double copy_bw = 2.0 * n * 4 / t_copy / 1e9, plain_bw = 7.0 * n * 4 / t_plain / 1e9, tma_bw = 7.0 * n * 4 / t_tma / 1e9,
               chunked_bw = 7.0 * n * 4 / t_chunked / 1e9;
  std::printf("2^%d floats per stream\n", log2n);
  std::printf("copy 1R1W plain: %.3f ms, %.3f TB/s\n", t_copy, copy_bw);
  std::printf("adam 4R3W plain: %.3f ms, %.3f TB/s (%.1f%% of copy)\n", t_plain, plain_bw, 100 * plain_bw / copy_bw);
  std::printf("adam 4R3W block per 64K chunk: %.3f ms, %.3f TB/s (%.1f%% of copy)\n", t_chunked, chunked_bw,
              100 * chunked_bw / copy_bw);
  const char* half_names[2] = {"plain ", "cp.async 3 tiles ahead"};
  for (int staged = 0; staged < 2; ++staged) {
    const double bw = 7.0 * n * 4 / t_half[staged] / 1e9;
    std::printf("adam 4R3W chunked, 1024 threads/SM, %s: %.3f ms, %.3f TB/s (%.1f%% of copy)\n", half_names[staged],
                t_half[staged], bw, 100 * bw / copy_bw);
  }
  std::printf("adam 4R3W TMA:   %.3f ms, %.3f TB/s (%.1f%% of copy)\n", t_tma, tma_bw, 100 * tma_bw / copy_bw);
  return 0;
}
