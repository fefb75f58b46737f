// What the update op (UpdateOp in ops.h) and its rules share: the lists of
// an update table, one parameter group's hyperparameters, and what a rule
// provides. A rule is the element math of one optimizer (adam_math.h); the
// op around it loads and stores the lists, handles scaled states, remainders
// and groups, so adding a rule adds only its math.
//
// A rule Rule provides:
//   kName                      the operation's name in error messages
//   kRequired, kUnused         bit masks (list_bit) of the lists a table must
//                              hold and must not hold; the others are optional
//   Coeffs                     what the element math needs, folded per group
//   static Coeffs coeffs(const AdamGroup&, double grad_scale)
//   static void element(float& p, float g, float& m, float& v, float& vmax,
//                       bool has_max, const Coeffs&)
//                              one element, in place; an unused state loads as
//                              0 and whatever the rule leaves in it is dropped
//   static bool states_read_param(const AdamGroup&)
//                              whether the states' update reads the parameter
//   static void states(float p, float g, float& m, float& v, float& vmax,
//                      bool has_max, const Coeffs&)
//                              the states' part of element(), bit for bit; p
//                              is read only where states_read_param ([Note:
//                              params in the measure pass] in ops.h)
#pragma once

#include "scalar.h"

namespace shardadam {

enum UpdateList : int {
  kParam = 0,         // fp32/fp16/bf16 param or master; bf16 high half with remainders
  kGrad = 1,
  kExpAvg = 2,
  kExpAvgSq = 3,
  kMaxExpAvgSq = 4,   // AMSGrad, optional
  kParamOut = 5,      // optional copy of the new param in another dtype
  kRemainder = 6,     // optional int16 low half of the fp32 master
  kExpAvgBlocks = 7,  // block maxima of a blockwise 8-bit exp_avg ([Note: blockwise 8-bit states])
  kExpAvgSqBlocks = 8,  // block maxima of a blockwise 8-bit exp_avg_sq
  kUpdateLists = 9,
};

SHARDADAM_HD constexpr uint32_t list_bit(int l) { return uint32_t(1) << l; }

// One parameter group's hyperparameters, as the kernels receive them, for
// every rule: each rule reads the fields it needs (the name is Adam's, the
// first rule's; Python builds _core.AdamGroup for every rule).
// Kept in double, as torch.optim keeps them, so that derived coefficients
// such as 1 - beta2 round once to float (1 - float(0.999) is 1.3e-5 off).
struct AdamGroup {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adam_w_mode = true;      // decoupled decay (AdamW) instead of L2
  bool bias_correction = true;
  bool maximize = false;
  bool nesterov = false;   // Muon's momentum pass: the update looks ahead (muon_math.h)
  double lr_ratio = 1.0;   // Muon's update pass: the step is lr * lr_ratio (the shape's adjustment)
  ScalarSrc lr;
  ScalarSrc step;  // the step number of the update being applied (1 for the first)
};

}  // namespace shardadam
