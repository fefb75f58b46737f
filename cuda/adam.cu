// Adam on the GPU: the shared sequencing (cpp/launch.h) over the CUDA engine.
#include "multi_tensor_apply.cuh"

namespace shardadam {

// Kernels with fixed dtypes for the common tables (lists: param, grad,
// exp_avg, exp_avg_sq, max_exp_avg_sq, param_out, remainder, and the block
// maxima of blockwise exp_avg and exp_avg_sq); any other mix
// runs the general kernel, correct but slower.
template <>
struct OpFastDtypes<AdamOp> {
  static constexpr DType F32 = DType::F32, BF16 = DType::BF16, F16 = DType::F16, I16 = DType::I16,
                         F8 = DType::F8E4M3, Q8S = DType::Q8S, Q8U = DType::Q8U, None = DType::None;
  using type = DtypeList<
      FixedDtypes<F32, F32, F32, F32, None, None, None>,    // fp32
      FixedDtypes<F32, BF16, F32, F32, None, BF16, None>,   // fp32 master, bf16 model
      FixedDtypes<F32, F16, F32, F32, None, F16, None>,     // fp32 master, fp16 model
      FixedDtypes<F32, F32, F32, F32, None, BF16, None>,    // fp32 grads, bf16 param copy (sharded)
      FixedDtypes<F32, F32, F32, F32, None, F32, None>,     // fp32 grads, fp32 param copy (sharded)
      FixedDtypes<BF16, BF16, F32, F32, None, None, I16>,   // bf16 params + remainders
      FixedDtypes<BF16, BF16, F32, F32, None, None, None>,   // bf16 params as their own master
      // FP8 states: FP8 exp_avg, blockwise exp_avg_sq ([Note: FP8 second moments] in _storage.py)
      FixedDtypes<F32, F32, F8, Q8U, None, None, None, None, F32>,     // fp32
      FixedDtypes<F32, BF16, F8, Q8U, None, BF16, None, None, F32>,    // fp32 master, bf16 model
      FixedDtypes<F32, F32, F8, Q8U, None, BF16, None, None, F32>,     // fp32 grads, bf16 param copy (sharded)
      FixedDtypes<BF16, BF16, F8, Q8U, None, None, None, None, F32>,   // bf16 own master
      // Mixed state dtypes (TE's and Megatron's choices): bf16 for both; FP8
      // exp_avg with fp32 or bf16 exp_avg_sq; scaled fp16 for both.
      FixedDtypes<F32, F32, BF16, BF16, None, None, None>,     // fp32, bf16 states
      FixedDtypes<F32, BF16, BF16, BF16, None, BF16, None>,    // fp32 master, bf16 model, bf16 states
      FixedDtypes<F32, F32, BF16, BF16, None, BF16, None>,     // fp32 grads, bf16 param copy (sharded), bf16 states
      FixedDtypes<BF16, BF16, BF16, BF16, None, None, None>,   // bf16 own master, bf16 states
      FixedDtypes<F32, F32, F8, F32, None, None, None>,        // fp32, FP8 exp_avg
      FixedDtypes<F32, BF16, F8, F32, None, BF16, None>,       // fp32 master, bf16 model, FP8 exp_avg
      FixedDtypes<F32, F32, F8, F32, None, BF16, None>,        // fp32 grads, bf16 param copy (sharded), FP8 exp_avg
      FixedDtypes<BF16, BF16, F8, F32, None, None, None>,      // bf16 own master, FP8 exp_avg
      FixedDtypes<F32, F32, F8, BF16, None, None, None>,       // fp32, FP8 exp_avg, bf16 exp_avg_sq
      FixedDtypes<BF16, BF16, F8, BF16, None, None, None>,     // bf16 own master, FP8 exp_avg, bf16 exp_avg_sq
      FixedDtypes<F32, F32, F16, F16, None, None, None>,       // fp32, scaled fp16 states
      FixedDtypes<BF16, BF16, F16, F16, None, None, None>,     // bf16 own master, scaled fp16 states
      // blockwise 8-bit states (+ their block maxima)
      FixedDtypes<F32, F32, Q8S, Q8U, None, None, None, F32, F32>,     // fp32
      FixedDtypes<F32, BF16, Q8S, Q8U, None, BF16, None, F32, F32>,    // fp32 master, bf16 model
      FixedDtypes<F32, F32, Q8S, Q8U, None, BF16, None, F32, F32>,     // fp32 grads, bf16 param copy (sharded)
      FixedDtypes<BF16, BF16, Q8S, Q8U, None, None, None, F32, F32>>;  // bf16 own master
};

void cuda_adam(const TensorTable& t, const CudaTarget& where, const std::vector<AdamGroup>& groups,
               const AdamExtras& x) {
  DeviceGuard guard(where.device);
  run_update<AdamRule>(make_engine(t, where), t, groups, x);
}

}  // namespace shardadam
