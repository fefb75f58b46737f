// The per-element Adam update, written once for the CPU and the CUDA engine.
// Hyperparameters are folded per group into coefficients so that the element
// math has no branches on modes (AdamW vs L2, maximize, bias correction): the
// CPU compiler vectorises it and GPU warps never diverge.
#pragma once

#include <cmath>

#include "update_rule.h"

namespace shardadam {

struct AdamCoeffs {
  float grad_mul;   // grad scale, negated for maximize
  float l2;         // weight decay added to the gradient (L2 mode), else 0
  float decay;      // 1 - lr * weight_decay (AdamW mode), else 1
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
  float eps;
};

// Bias corrections in double, as torch.optim computes them, then rounded once.
SHARDADAM_HD AdamCoeffs make_adam_coeffs(const AdamGroup& g, double grad_scale) {
  const double lr = g.lr.read();
  const double step = g.step.read();
  const double bc1 = g.bias_correction ? 1.0 - pow(g.beta1, step) : 1.0;
  const double bc2 = g.bias_correction ? 1.0 - pow(g.beta2, step) : 1.0;
  AdamCoeffs c;
  c.grad_mul = float(g.maximize ? -grad_scale : grad_scale);
  c.l2 = g.adam_w_mode ? 0.0f : float(g.weight_decay);
  c.decay = g.adam_w_mode ? float(1.0 - lr * g.weight_decay) : 1.0f;
  c.beta1 = float(g.beta1);
  c.one_minus_beta1 = float(1.0 - g.beta1);
  c.beta2 = float(g.beta2);
  c.one_minus_beta2 = float(1.0 - g.beta2);
  c.step_size = float(lr / bc1);
  c.bc2_sqrt = float(sqrt(bc2));
  c.eps = float(g.eps);
  return c;
}

// The gradient Adam's states see: scaled, negated for maximize, plus the L2
// decay of the parameter (only in L2 mode: 0 * p would turn an infinite param
// into a NaN gradient).
SHARDADAM_HD float adam_grad(float p, float g, const AdamCoeffs& c) {
  g = g * c.grad_mul;
  if (c.l2 != 0.0f) g += c.l2 * p;
  return g;
}

// The states' update from that gradient. `vmax` is the AMSGrad running
// maximum when has_max, ignored otherwise.
SHARDADAM_HD void adam_states(float g, float& m, float& v, float& vmax, bool has_max, const AdamCoeffs& c) {
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
  vmax = has_max ? nan_max(vmax, v) : v;
}

// One element: the states, then the parameter.
SHARDADAM_HD void adam_element(float& p, float g, float& m, float& v, float& vmax,
                               bool has_max, const AdamCoeffs& c) {
  g = adam_grad(p, g, c);
  p = p * c.decay;
  adam_states(g, m, v, vmax, has_max, c);
  const float denom = sqrtf(vmax) / c.bc2_sqrt + c.eps;
  p = p - c.step_size * m / denom;
}

// Adam as a rule of UpdateOp (ops.h, update_rule.h).
struct AdamRule {
  static constexpr const char* kName = "adam";
  static constexpr uint32_t kRequired =
      list_bit(kParam) | list_bit(kGrad) | list_bit(kExpAvg) | list_bit(kExpAvgSq);
  static constexpr uint32_t kUnused = 0;
  using Coeffs = AdamCoeffs;
  SHARDADAM_HD static Coeffs coeffs(const AdamGroup& g, double grad_scale) {
    return make_adam_coeffs(g, grad_scale);
  }
  SHARDADAM_HD static void element(float& p, float g, float& m, float& v, float& vmax, bool has_max,
                                   const Coeffs& c) {
    adam_element(p, g, m, v, vmax, has_max, c);
  }
  SHARDADAM_HD static bool states_read_param(const AdamGroup& g) { return !g.adam_w_mode && g.weight_decay != 0.0; }
  SHARDADAM_HD static void states(float p, float g, float& m, float& v, float& vmax, bool has_max,
                                  const Coeffs& c) {
    adam_states(adam_grad(p, g, c), m, v, vmax, has_max, c);
  }
};

}  // namespace shardadam
