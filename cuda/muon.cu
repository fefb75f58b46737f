// Muon's element-wise passes on the GPU (cpp/muon_math.h): the shared
// sequencing (cpp/launch.h) over the CUDA engine.
#include "muon_math.h"
#include "multi_tensor_apply.cuh"

namespace shardadam {

// Kernels with fixed dtypes for the common tables (lists: param, grad,
// exp_avg, exp_avg_sq, max_exp_avg_sq, param_out, remainder). The momentum
// pass writes the Newton-Schulz input (bf16 on CUDA) into the param list.
template <>
struct OpFastDtypes<UpdateOp<MuonMomentumRule>> {
  static constexpr DType F32 = DType::F32, BF16 = DType::BF16, None = DType::None;
  using type = DtypeList<
      FixedDtypes<BF16, F32, F32, None, None, None, None>,    // fp32 grads and momentum
      FixedDtypes<BF16, BF16, BF16, None, None, None, None>,  // bf16 grads and momentum
      FixedDtypes<F32, F32, F32, None, None, None, None>>;    // fp32 Newton-Schulz
};

// The update pass reads the orthogonalized update (the grad list).
template <>
struct OpFastDtypes<UpdateOp<MuonUpdateRule>> {
  static constexpr DType F32 = DType::F32, BF16 = DType::BF16, None = DType::None;
  using type = DtypeList<
      FixedDtypes<F32, BF16, None, None, None, None, None>,    // fp32 params
      FixedDtypes<BF16, BF16, None, None, None, None, None>,   // bf16 params
      FixedDtypes<F32, F32, None, None, None, None, None>>;    // fp32 Newton-Schulz
};

void cuda_muon_momentum(const TensorTable& t, const CudaTarget& where, const std::vector<AdamGroup>& groups,
                        const AdamExtras& x) {
  DeviceGuard guard(where.device);
  run_update<MuonMomentumRule>(make_engine(t, where), t, groups, x);
}

void cuda_muon_update(const TensorTable& t, const CudaTarget& where, const std::vector<AdamGroup>& groups,
                      const AdamExtras& x) {
  DeviceGuard guard(where.device);
  run_update<MuonUpdateRule>(make_engine(t, where), t, groups, x);
}

}  // namespace shardadam
