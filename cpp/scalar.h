// A scalar that lives either on the host (a number passed by value) or in
// memory the kernel can read (a device tensor for CUDA, a CPU tensor for CPU).
// Reading it inside the kernel is what makes lr, step and grad scale
// CUDA-graph capturable: nothing is read back to the host.
#pragma once

#include "dtype.h"

namespace shardadam {

struct ScalarSrc {
  double value = 0.0;        // used when ptr is null
  const void* ptr = nullptr;  // element 0 of a tensor of `dtype`
  DType dtype = DType::None;

  SHARDADAM_HD double read() const {
    if (ptr == nullptr) return value;
    switch (dtype) {
      case DType::F32: return double(*static_cast<const float*>(ptr));
      case DType::F64: return *static_cast<const double*>(ptr);
      case DType::I32: return double(*static_cast<const int32_t*>(ptr));
      case DType::I64: return double(*static_cast<const int64_t*>(ptr));
      default: return value;
    }
  }
};

// A found-inf style flag: a float32 tensor element, nonzero means "set".
SHARDADAM_HD bool flag_is_set(const float* flag) { return flag != nullptr && *flag != 0.0f; }

SHARDADAM_HD bool is_finite(float x) {
  return (float_bits(x) & 0x7f800000u) != 0x7f800000u;
}

// a * b rounded on its own. nvcc fuses a product into the add that follows
// (one rounding where torch's separate mul_ and add_ round twice); where an
// update must round as torch's in-place steps do, this keeps them apart.
SHARDADAM_HD float mul_rounded(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// max that propagates NaN from either side, like torch.maximum.
SHARDADAM_HD float nan_max(float a, float b) {
  return (a != a || a > b) ? a : b;
}

}  // namespace shardadam
