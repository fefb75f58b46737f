// How each operation is sequenced over a table: group slices, the two passes
// of scaled states, the norm's finalize step. Written once as templates over
// an Engine, which the CPU (cpp/kernels_cpu.cpp) and CUDA (cuda/*.cu) builds
// provide:
//   apply(chunk_begin, chunk_end, op, skip_if)   run op over a chunk range
//   zero(float* p, n)                             clear scratch
//   commit_scales(UpdateArgs, num_tensors, skip_if) scales <- f(amax)
//   finalize_norm(partials, per_tensor, total)    per-tensor and total norms
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "ops.h"

namespace shardadam {

// The per-call inputs of an update beyond the groups, for every rule (the
// name is Adam's, the first rule's; Python builds _core.AdamExtras).
struct AdamExtras {
  ScalarSrc grad_scale{1.0, nullptr, DType::None};
  uint64_t found_inf = 0;  // float32 flag: set -> the step writes nothing
  uint64_t scales[kScaledStates] = {0, 0, 0};  // float32 [num_tensors] each, or 0
  uint64_t amax_scratch = 0;  // float32 [3 * num_tensors], needed with scales
  bool unscale_grads = false;  // see UpdateArgs::unscale_grads
  bool stochastic_rounding = false;  // see UpdateArgs::stochastic_rounding
  uint64_t rounding_seed = 0;
};

// Dtype and presence rules for update tables (cpp/check_update.cpp); called
// once when a plan is built. `scaled`: bit i set when ScaledState i has
// scales. `required`, `unused`: list_bit masks.
void check_update_table(const TensorTable& t, uint32_t scaled, const std::string& rule,
                        uint32_t required, uint32_t unused);

template <class Rule>
void check_table(const TensorTable& t, uint32_t scaled) {
  check_update_table(t, scaled, Rule::kName, Rule::kRequired, Rule::kUnused);
}

template <class Rule, class Engine>
void run_update(const Engine& e, const TensorTable& t, const std::vector<AdamGroup>& groups,
                const AdamExtras& x) {
  const std::string name = Rule::kName;
  SHARDADAM_CHECK(int64_t(groups.size()) == t.num_groups(),
                  name + ": " + std::to_string(groups.size()) + " groups given for a table of " +
                      std::to_string(t.num_groups()) + " groups");
  UpdateOp<Rule> op;
  op.a.grad_scale = x.grad_scale;
  if (x.unscale_grads) t.check_writable(kGrad);
  op.a.unscale_grads = x.unscale_grads;
  op.a.stochastic_rounding = x.stochastic_rounding;
  op.a.rounding_seed = x.rounding_seed;
  bool scaled = false;
  static constexpr const char* kScaleNames[kScaledStates] = {"master_scales", "exp_avg_scales",
                                                             "exp_avg_sq_scales"};
  for (int i = 0; i < kScaledStates; ++i) {
    SHARDADAM_CHECK(!(x.scales[i] && (Rule::kUnused & list_bit(kScaledList[i]))),
                    name + ": " + kScaleNames[i] + " given for a state " + name + " does not keep");
    op.a.scales[i] = reinterpret_cast<float*>(x.scales[i]);
    op.a.scale_top[i] = t.list_dtype_is(kScaledList[i], DType::F8E4M3) ? kF8ScaleTop : kF16ScaleTop;
    scaled |= x.scales[i] != 0;
  }
  const float* skip_if = reinterpret_cast<const float*>(x.found_inf);
  std::vector<UpdatePhase> phases{UpdatePhase::Apply};
  if (scaled) {
    SHARDADAM_CHECK(x.amax_scratch != 0, name + ": scaled states need an amax scratch buffer");
    float* scratch = reinterpret_cast<float*>(x.amax_scratch);
    for (int i = 0; i < kScaledStates; ++i) op.a.amax[i] = scratch + i * t.num_tensors();
    e.zero(scratch, kScaledStates * t.num_tensors());
    phases = {UpdatePhase::Measure, UpdatePhase::ApplyScaled};
    op.a.params_in_measure = !x.scales[kScaledMaster] &&
                             std::none_of(groups.begin(), groups.end(), Rule::states_read_param);
  }
  for (UpdatePhase phase : phases) {
    op.a.phase = phase;
    for (int64_t g0 = 0; g0 < t.num_groups(); g0 += kMaxGroupsPerLaunch) {
      const int64_t g1 = std::min<int64_t>(g0 + kMaxGroupsPerLaunch, t.num_groups());
      for (int64_t g = g0; g < g1; ++g) op.a.groups[g - g0] = groups[g];
      op.a.group_base = uint32_t(g0);
      e.apply(t.group_chunk_begin(g0), t.group_chunk_begin(g1), op, skip_if);
    }
  }
  if (scaled) e.commit_scales(op.a, t.num_tensors(), skip_if);
}

template <class Engine>
void run_scale(const Engine& e, const TensorTable& t, ScalarSrc scale, uint64_t found_inf,
               uint64_t skip_if) {
  SHARDADAM_CHECK(t.num_lists() == ScaleOp::kLists && t.list(2).blocks_of == 0 && t.list(3).blocks_of == 1,
                  "scale: a table needs 4 lists: inputs, outputs, and their block maxima (marked as theirs)");
  ScaleOp op;
  op.scale = scale;
  op.found_inf = reinterpret_cast<float*>(found_inf);
  e.apply(0, t.num_chunks(), op, reinterpret_cast<const float*>(skip_if));
}

// The dtype of every tensor of each list, and which lists are marked written
// (so the table refused written memory that overlaps any other), for ops with
// fixed dtypes (cpp/check_fixed_dtypes.cpp).
void check_fixed_dtypes(const TensorTable& t, const std::string& op, const DType* dtypes, int num_lists,
                        uint32_t written);

// split_remainders / join_remainders: one pass over every chunk. Their tables
// are checked on every call (O(tensors), host only): the 16-bit lists are
// moved as raw bits whatever their dtype code says, so a table of other
// dtypes would address memory past its tensors.
template <class Op, class Engine>
void run_remainders(const Engine& e, const TensorTable& t) {
  check_fixed_dtypes(t, Op::kName, Op::kDtypes, Op::kLists, Op::kWritten);
  e.apply(0, t.num_chunks(), Op{}, nullptr);
}

// partials: float32 [num_chunks] scratch. per_tensor: float32 [num_tensors] or 0.
template <class Engine>
void run_l2_norm(const Engine& e, const TensorTable& t, uint64_t partials, uint64_t per_tensor,
                 uint64_t total, uint64_t nonfinite) {
  SHARDADAM_CHECK(t.num_lists() == SumSqOp::kLists, "l2_norm: a table needs 1 list");
  SumSqOp op;
  op.partials = reinterpret_cast<float*>(partials);
  op.nonfinite = reinterpret_cast<float*>(nonfinite);
  e.apply(0, t.num_chunks(), op, nullptr);
  e.finalize_norm(op.partials, reinterpret_cast<float*>(per_tensor), reinterpret_cast<float*>(total));
}

}  // namespace shardadam
