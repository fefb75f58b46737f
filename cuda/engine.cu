// The small kernels around multi-tensor passes, and build/runtime queries.
#include "multi_tensor_apply.cuh"

namespace shardadam {
namespace {

__global__ void commit_scales_kernel(const __grid_constant__ UpdateArgs a, int64_t num_tensors,
                                     const float* skip_if) {
  if (flag_is_set(skip_if)) return;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < num_tensors;
       t += int64_t(gridDim.x) * blockDim.x)
    for (int i = 0; i < kScaledStates; ++i)
      if (a.scales[i]) a.scales[i][t] = pow2_scale_for(a.amax[i][t], a.scales[i][t], a.scale_top[i]);
}

// One block: each thread adds its tensors' chunk partials in order, then the
// block adds the threads' sums in a fixed tree. Deterministic.
__global__ void __launch_bounds__(kBlock)
    finalize_norm_kernel(const TableView tv, const float* partials, float* per_tensor, float* total) {
  float acc = 0.0f;
  for (int64_t t = threadIdx.x; t < tv.num_tensors; t += blockDim.x) {
    float s = 0.0f;
    for (int64_t c = tv.tensor_chunks[t]; c < tv.tensor_chunks[t + 1]; ++c) s += partials[c];
    if (per_tensor) per_tensor[t] = sqrtf(s);
    acc += s;
  }
  CudaReducer red;
  red.sum_to(total, acc);
  __syncthreads();
  if (threadIdx.x == 0) *total = sqrtf(*total);
}

}  // namespace

void launch_commit_scales(const UpdateArgs& a, int64_t num_tensors, const float* skip_if,
                          cudaStream_t stream) {
  if (num_tensors == 0) return;
  const int64_t blocks = (num_tensors + 255) / 256;
  commit_scales_kernel<<<unsigned(blocks < 1024 ? blocks : 1024), 256, 0, stream>>>(a, num_tensors, skip_if);
  cuda_check(cudaGetLastError(), "commit_scales_kernel launch");
}

void launch_finalize_norm(const TableView& tv, const float* partials, float* per_tensor,
                          float* total, cudaStream_t stream) {
  finalize_norm_kernel<<<1, kBlock, 0, stream>>>(tv, partials, per_tensor, total);
  cuda_check(cudaGetLastError(), "finalize_norm_kernel launch");
}

bool cuda_built() { return true; }

std::string cuda_architectures() { return SHARDADAM_CUDA_ARCHS; }

int cuda_runtime_version() {
  int v = 0;
  return cudaRuntimeGetVersion(&v) == cudaSuccess ? v : 0;
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no GPU: not an error for a query
    return 0;
  }
  return n;
}

}  // namespace shardadam
