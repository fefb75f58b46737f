// The per-element Lion update (Chen et al. 2023, "Symbolic Discovery of
// Optimization Algorithms"; lion-pytorch's update_fn), a rule of UpdateOp
// (ops.h, update_rule.h). Its only state is exp_avg.
#pragma once

#include "update_rule.h"

namespace shardadam {

struct LionCoeffs {
  float grad_mul;  // grad scale, negated for maximize
  float decay;     // 1 - lr * weight_decay (decoupled)
  float lr;
  float beta1, one_minus_beta1;  // the update's interpolation
  float beta2, one_minus_beta2;  // the momentum's
};

// Derived in double, as torch computes 1 - lr * wd from Python floats, then
// rounded once.
SHARDADAM_HD LionCoeffs make_lion_coeffs(const AdamGroup& g, double grad_scale) {
  const double lr = g.lr.read();
  LionCoeffs c;
  c.grad_mul = float(g.maximize ? -grad_scale : grad_scale);
  c.decay = float(1.0 - lr * g.weight_decay);
  c.lr = float(lr);
  c.beta1 = float(g.beta1);
  c.one_minus_beta1 = float(1.0 - g.beta1);
  c.beta2 = float(g.beta2);
  c.one_minus_beta2 = float(1.0 - g.beta2);
  return c;
}

// 1, -1, or +0 for either zero (as torch.sign); NaN stays NaN, so that a
// non-finite gradient shows in the param instead of freezing it silently
// (torch.sign gives 0 for NaN).
SHARDADAM_HD float lion_sign(float x) {
  return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? 0.0f : x));
}

// The momentum's update from the scaled gradient.
SHARDADAM_HD void lion_momentum(float g, float& m, const LionCoeffs& c) { m = c.beta2 * m + c.one_minus_beta2 * g; }

SHARDADAM_HD void lion_element(float& p, float g, float& m, const LionCoeffs& c) {
  g = g * c.grad_mul;
  p = mul_rounded(p, c.decay);  // then p - lr * sign: exact product, one rounding, as lion-pytorch's two steps
  const float update = c.beta1 * m + c.one_minus_beta1 * g;
  p = p - c.lr * lion_sign(update);
  lion_momentum(g, m, c);
}

struct LionRule {
  static constexpr const char* kName = "lion";
  static constexpr uint32_t kRequired = list_bit(kParam) | list_bit(kGrad) | list_bit(kExpAvg);
  static constexpr uint32_t kUnused = list_bit(kExpAvgSq) | list_bit(kMaxExpAvgSq);
  using Coeffs = LionCoeffs;
  SHARDADAM_HD static Coeffs coeffs(const AdamGroup& g, double grad_scale) {
    return make_lion_coeffs(g, grad_scale);
  }
  SHARDADAM_HD static void element(float& p, float g, float& m, float&, float&, bool, const Coeffs& c) {
    lion_element(p, g, m, c);
  }
  SHARDADAM_HD static bool states_read_param(const AdamGroup&) { return false; }  // decay is decoupled
  SHARDADAM_HD static void states(float, float g, float& m, float&, float&, bool, const Coeffs& c) {
    lion_momentum(g * c.grad_mul, m, c);
  }
};

}  // namespace shardadam
