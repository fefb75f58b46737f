// fp32 masters <-> bf16 params + int16 remainders on the GPU.
#include "multi_tensor_apply.cuh"

namespace shardadam {

void cuda_split_remainders(const TensorTable& t, const CudaTarget& where) {
  DeviceGuard guard(where.device);
  run_remainders<SplitRemaindersOp>(make_engine(t, where), t);
}

void cuda_join_remainders(const TensorTable& t, const CudaTarget& where) {
  DeviceGuard guard(where.device);
  run_remainders<JoinRemaindersOp>(make_engine(t, where), t);
}

}  // namespace shardadam
