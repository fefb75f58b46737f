// Lion on the GPU: the shared sequencing (cpp/launch.h) over the CUDA engine.
#include "lion_math.h"
#include "multi_tensor_apply.cuh"

namespace shardadam {

// Kernels with fixed dtypes for the common tables, as Adam's (cuda/adam.cu)
// with exp_avg_sq and max_exp_avg_sq absent.
template <>
struct OpFastDtypes<UpdateOp<LionRule>> {
  static constexpr DType F32 = DType::F32, BF16 = DType::BF16, F16 = DType::F16, I16 = DType::I16,
                         F8 = DType::F8E4M3, Q8S = DType::Q8S, None = DType::None;
  using type = DtypeList<
      FixedDtypes<F32, F32, F32, None, None, None, None>,    // fp32
      FixedDtypes<F32, BF16, F32, None, None, BF16, None>,   // fp32 master, bf16 model
      FixedDtypes<F32, F16, F32, None, None, F16, None>,     // fp32 master, fp16 model
      FixedDtypes<F32, F32, F32, None, None, BF16, None>,    // fp32 grads, bf16 param copy (sharded)
      FixedDtypes<F32, F32, F32, None, None, F32, None>,     // fp32 grads, fp32 param copy (sharded)
      FixedDtypes<BF16, BF16, F32, None, None, None, I16>,   // bf16 params + remainders
      FixedDtypes<BF16, BF16, F32, None, None, None, None>,   // bf16 params as their own master
      FixedDtypes<F32, F32, F8, None, None, None, None>,      // fp32, FP8 exp_avg
      FixedDtypes<F32, F32, Q8S, None, None, None, None, F32, None>,     // fp32, blockwise 8-bit exp_avg
      FixedDtypes<F32, BF16, Q8S, None, None, BF16, None, F32, None>,    // fp32 master, bf16 model
      FixedDtypes<BF16, BF16, Q8S, None, None, None, None, F32, None>>;  // bf16 own master
};

void cuda_lion(const TensorTable& t, const CudaTarget& where, const std::vector<AdamGroup>& groups,
               const AdamExtras& x) {
  DeviceGuard guard(where.device);
  run_update<LionRule>(make_engine(t, where), t, groups, x);
}

}  // namespace shardadam
