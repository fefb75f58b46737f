// The element-wise parts of Muon (Jordan et al. 2024, "Muon: An optimizer for
// hidden layers in neural networks"; torch.optim.Muon's update), two rules of
// UpdateOp (ops.h, update_rule.h). Newton-Schulz sits between them and runs in
// torch (batched matmuls, python/shardadam/_newton_schulz.py):
//
//   momentum pass (MuonMomentumRule): exp_avg is the momentum buffer, the
//     param list is the Newton-Schulz input (written, never read):
//       buf = lerp(buf, g, 1 - momentum)
//       in  = nesterov ? lerp(g, buf, momentum) : buf
//   update pass (MuonUpdateRule): the grad list holds the orthogonalized
//     update O of each matrix:
//       p = p * (1 - lr * weight_decay) - lr * lr_ratio * O   (torch's mul_, then add_)
//
// AdamGroup fields read: beta1 is the momentum, nesterov; lr, weight_decay
// and lr_ratio (the shape's learning-rate adjustment) in the update pass.
#pragma once

#include <cmath>

#include "update_rule.h"

namespace shardadam {

// torch's lerp (aten's lerp kernels): start + w * (end - start) for |w| < 0.5,
// end + (w - 1) * (end - start) otherwise, so that w = 1 gives end exactly;
// each a fused multiply-add, as torch's vectorised CPU kernel and its CUDA
// kernel (contracted by nvcc) compute it.
SHARDADAM_HD float torch_lerp(float start, float end, float w) {
  const float diff = end - start;
  return fabsf(w) < 0.5f ? fmaf(w, diff, start) : fmaf(w - 1.0f, diff, end);
}

struct MuonMomentumCoeffs {
  float grad_mul;  // the gradients' scale (GradScaler's 1 / scale)
  float momentum;
  float one_minus_momentum;  // in double, rounded once (torch's 1 - momentum from Python floats)
  bool nesterov;
};

SHARDADAM_HD MuonMomentumCoeffs make_muon_momentum_coeffs(const AdamGroup& g, double grad_scale) {
  MuonMomentumCoeffs c;
  c.grad_mul = float(grad_scale);
  c.momentum = float(g.beta1);
  c.one_minus_momentum = float(1.0 - g.beta1);
  c.nesterov = g.nesterov;
  return c;
}

SHARDADAM_HD void muon_momentum(float g, float& buf, const MuonMomentumCoeffs& c) {
  buf = torch_lerp(buf, g, c.one_minus_momentum);
}

struct MuonMomentumRule {
  static constexpr const char* kName = "muon_momentum";
  static constexpr uint32_t kRequired = list_bit(kParam) | list_bit(kGrad) | list_bit(kExpAvg);
  static constexpr uint32_t kUnused = list_bit(kExpAvgSq) | list_bit(kMaxExpAvgSq) | list_bit(kParamOut) |
                                      list_bit(kRemainder) | list_bit(kExpAvgSqBlocks);
  using Coeffs = MuonMomentumCoeffs;
  SHARDADAM_HD static Coeffs coeffs(const AdamGroup& g, double grad_scale) {
    return make_muon_momentum_coeffs(g, grad_scale);
  }
  // `p` is the Newton-Schulz input: overwritten, its old value unused.
  SHARDADAM_HD static void element(float& p, float g, float& buf, float&, float&, bool, const Coeffs& c) {
    g = g * c.grad_mul;
    muon_momentum(g, buf, c);
    p = c.nesterov ? torch_lerp(g, buf, c.momentum) : buf;
  }
  SHARDADAM_HD static bool states_read_param(const AdamGroup&) { return false; }
  SHARDADAM_HD static void states(float, float g, float& buf, float&, float&, bool, const Coeffs& c) {
    muon_momentum(g * c.grad_mul, buf, c);
  }
};

struct MuonUpdateCoeffs {
  float grad_mul;  // 1 in the optimizer: the orthogonalized update carries no scale
  float decay;     // 1 - lr * weight_decay (decoupled; torch decays with the unadjusted lr)
  float step;      // lr * lr_ratio
};

// Derived in double, as torch computes them from Python floats, then rounded once.
SHARDADAM_HD MuonUpdateCoeffs make_muon_update_coeffs(const AdamGroup& g, double grad_scale) {
  const double lr = g.lr.read();
  MuonUpdateCoeffs c;
  c.grad_mul = float(grad_scale);
  c.decay = float(1.0 - lr * g.weight_decay);
  c.step = float(lr * g.lr_ratio);
  return c;
}

struct MuonUpdateRule {
  static constexpr const char* kName = "muon_update";
  static constexpr uint32_t kRequired = list_bit(kParam) | list_bit(kGrad);
  static constexpr uint32_t kUnused = list_bit(kExpAvg) | list_bit(kExpAvgSq) | list_bit(kMaxExpAvgSq) |
                                      list_bit(kExpAvgBlocks) | list_bit(kExpAvgSqBlocks);
  using Coeffs = MuonUpdateCoeffs;
  SHARDADAM_HD static Coeffs coeffs(const AdamGroup& g, double grad_scale) {
    return make_muon_update_coeffs(g, grad_scale);
  }
  // `g` is the orthogonalized update. p * decay rounded, then p - step * O
  // in one fused multiply-add: torch's mul_, then its add_(O, alpha=-step),
  // which fuses on the CPU (vectorised fmadd) and on CUDA alike.
  SHARDADAM_HD static void element(float& p, float g, float&, float&, float&, bool, const Coeffs& c) {
    p = mul_rounded(p, c.decay);
    p = fmaf(-c.step, g * c.grad_mul, p);
  }
  SHARDADAM_HD static bool states_read_param(const AdamGroup&) { return false; }
  SHARDADAM_HD static void states(float, float, float&, float&, float&, bool, const Coeffs&) {}
};

}  // namespace shardadam
