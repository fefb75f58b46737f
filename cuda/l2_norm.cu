// Total and per-tensor L2 norms on the GPU.
#include "multi_tensor_apply.cuh"

namespace shardadam {

void cuda_l2_norm(const TensorTable& t, const CudaTarget& where, uint64_t partials,
                  uint64_t per_tensor, uint64_t total, uint64_t nonfinite) {
  DeviceGuard guard(where.device);
  run_l2_norm(make_engine(t, where), t, partials, per_tensor, total, nonfinite);
}

}  // namespace shardadam
