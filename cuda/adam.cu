// Adam on the GPU: the shared sequencing (cpp/launch.h) over the CUDA engine.
#include "multi_tensor_apply.cuh"

namespace shardadam {

void cuda_adam(const TensorTable& t, const CudaTarget& where, const std::vector<AdamGroup>& groups,
               const AdamExtras& x) {
  DeviceGuard guard(where.device);
  run_adam(make_engine(t, where), t, groups, x);
}

}  // namespace shardadam
