// Scale and cast-copy on the GPU.
#include "multi_tensor_apply.cuh"

namespace shardadam {

void cuda_scale(const TensorTable& t, const CudaTarget& where, ScalarSrc scale, uint64_t found_inf,
                uint64_t skip_if) {
  DeviceGuard guard(where.device);
  run_scale(make_engine(t, where), t, scale, found_inf, skip_if);
}

}  // namespace shardadam
